#!/usr/bin/env bash
# Build the venv of one vLLM release: venv.sh RELEASE VENV (e.g. venv.sh 0.30 .venv-vllm-0.30).
# The same pinned environment as .venv (../requirements-cpu.lock, installed --no-deps), with the
# pins that RELEASE.txt replaces; then torch, kvelastic and the plugin (editable), as `make setup`.
set -euo pipefail
release=$1 venv=$2
here=$(cd "$(dirname "$0")" && pwd)
overrides=$here/$release.txt
[ -f "$overrides" ] || { echo "no $overrides: known releases: $(cd "$here" && ls ./*.txt | sed 's|./||; s|\.txt||' | tr '\n' ' ')" >&2; exit 2; }
python=${PYTHON:-python3}
torch=${TORCH:-torch==2.13.0}

# the lock, less every package RELEASE.txt names, then RELEASE.txt
"$python" - "$here/../requirements-cpu.lock" "$overrides" > "$venv.requirements.tmp" <<'PY'
import re, sys
name = lambda line: re.split(r"[=<>!~;\[ ]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
lines = lambda path: [ln.split(" #")[0].strip() for ln in open(path) if ln.strip() and not ln.startswith("#")]
lock, over = lines(sys.argv[1]), lines(sys.argv[2])
replaced = {name(ln) for ln in over}
print("\n".join([ln for ln in lock if name(ln) not in replaced] + over))
PY

pip() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
test -x "$venv/bin/python" || "$python" -m venv "$venv"
mv "$venv.requirements.tmp" "$venv/requirements.txt"
pip --upgrade pip wheel
"$venv/bin/python" -c 'import torch' 2>/dev/null || pip "$torch"
pip --no-deps -r "$venv/requirements.txt"
pip -e "$here/../../..[test]" -e "$here/.." -e "$here/../../../tools"
# What pip's metadata check finds, less what is left out or pinned on purpose (no CPU builds of
# torchvision/torchaudio/torchcodec; triton; Dynamo's indexer, --no-deps as in make setup) and its
# platform note: nothing else may remain.
conflicts=$("$venv/bin/python" -m pip check 2>&1 | grep -vE 'torchvision|torchaudio|torchcodec|triton|ai-dynamo-runtime|not supported on this platform' || true)
[ -z "$conflicts" ] || { echo "$venv: $release.txt leaves requirements unmet:"; echo "$conflicts"; exit 1; } >&2
"$venv/bin/python" - "$release" <<'PY'
import sys, vllm, kvelastic, kvelastic_vllm, torch, pytest  # noqa: F401
assert vllm.__version__.startswith(sys.argv[1] + "."), f"{vllm.__version__} is not vLLM {sys.argv[1]}"
print(f"{sys.prefix}: vLLM {vllm.__version__}, torch {torch.__version__}")
PY
