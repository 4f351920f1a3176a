"""Run real vLLM, offline, on a GPU machine from the kernel-free bundle (see vllmbundle.py).

On the GPU machine, from the repository root with ``.gpu-wheels`` carried::

    PYTHONPATH=.:tools python3 -m kvelastic_tools.gpucheck.vllmsmoke

It makes pyzmq/msgspec importable from the carried wheels (wheels.ensure), unpacks
``.gpu-wheels/vllm/site.zip`` into a temporary folder, builds a tiny random-weight
Llama (kvelastic_tools.vllm_bench.tinymodel: byte-level BPE tokenizer trained in code,
weights of std 0.5 so greedy decoding walks through varied tokens), and runs
``vllm.LLM(...).generate`` greedy with the bundle's engine arguments (Triton attention,
native custom and IR ops). Each attempt runs in a child process, so that a hang or a
crash is bounded and reported: first with vLLM's default layout (EngineCore in its own
process), and, only if that fails, once more in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The last line printed is one JSON object:
the tokens, the plain-transformers greedy reference and how far each prompt agrees
with it, load time, first-request TTFT, and every error with its traceback and log tail.
With ``$OUT`` set, the report and each attempt's full log are written there as well.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
WHEELS = REPO / ".gpu-wheels"
BUNDLE = Path(os.environ.get("KVELASTIC_VLLM_BUNDLE", WHEELS / "vllm"))  # another build, for rehearsals
MARK = "VLLMSMOKE "
PROMPTS = ("the cache block", "alpha beta gamma delta", "one two three four five", "red green blue cat")
MAX_TOKENS = 16
ATTEMPT_TIMEOUT = {"mp": 150, "inproc": 90}  # seconds: the whole run stays under about 4 minutes
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def unpack_bundle(bundle: Path = BUNDLE) -> tuple[Path, dict]:
    """Unpack site.zip once into a temp folder named after its hash; return it and the manifest."""
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    archive = bundle / "site.zip"
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:12]
    site = Path(tempfile.gettempdir()) / f"kvelastic-vllm-{digest}"
    if not (site / "vllm" / "__init__.py").exists():
        tmp = Path(tempfile.mkdtemp(prefix=site.name + ".part", dir=site.parent))
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        tmp.rename(site)
    return site, manifest


def prepare() -> tuple[dict, dict]:
    """Make the kit's wheels and the bundle importable here and in children; return (env, manifest)."""
    from kvelastic_tools.gpucheck.wheels import ensure

    kit_site, _notes = ensure(WHEELS)
    site, manifest = unpack_bundle()
    # The image's own site-packages come first in this process, and the bundle holds no distribution
    # the image has (manifest image_overlap), so the order in the children's PYTHONPATH is harmless.
    sys.path.append(str(site))
    paths = [str(REPO), str(REPO / "tools")] + ([str(kit_site)] if kit_site else []) + [str(site)]
    paths += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(paths)}
    return env, manifest


def build_model(where: Path) -> Path:
    """The tiny Llama: hidden 256, 2 layers, 4 heads of 64, float32 (so plain transformers on the CPU
    gives a greedy reference to compare with)."""
    from kvelastic_tools.vllm_bench.tinymodel import Shape, build_tiny_llama

    shape = Shape(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64, max_pos=512,
                  dtype="float32")
    return build_tiny_llama(where / "tiny-llama", shape)


def reference(model: Path) -> list[list[int]]:
    """Greedy continuations with plain transformers on the CPU (no vLLM)."""
    from kvelastic_tools.vllm_bench.tinymodel import greedy_tokens

    return [greedy_tokens(model, p, MAX_TOKENS) for p in PROMPTS]


def attempt(model: Path, engine_args: dict) -> dict:
    """Child side: start vLLM on the model, time it, generate greedy, return what happened."""
    out: dict = {"multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "(default)")}
    try:
        t = time.monotonic()
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        out.update(vllm=vllm.__version__, vllm_file=vllm.__file__, torch=torch.__version__,
                   import_s=round(time.monotonic() - t, 2))
        t = time.monotonic()
        llm = LLM(model=str(model), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
                  max_model_len=256, seed=0, **engine_args)
        out["load_s"] = round(time.monotonic() - t, 2)
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        t = time.monotonic()
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        out["first_request_ttft_s"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        results = llm.generate(list(PROMPTS), greedy, use_tqdm=False)
        out["generate_s"] = round(time.monotonic() - t, 3)
        out["tokens"] = [list(r.outputs[0].token_ids) for r in results]
        out["texts"] = [r.outputs[0].text for r in results]
        out["platform"] = type(vllm.platforms.current_platform).__name__
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        config = getattr(llm.llm_engine, "vllm_config", None)
        if config is not None:
            out["attention_backend"] = str(config.attention_config.backend)
            out["custom_ops"] = list(config.compilation_config.custom_ops)
            out["model_runner_v2"] = bool(config.use_v2_model_runner)  # vLLM 0.32's default where Triton is
        out["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the report is the point
        out.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2500:])
    return out


def run_attempt(kind: str, model: Path, env: dict, logs: Path | None) -> dict:
    """Parent side: run one attempt in a child process group, bounded by its timeout."""
    env = dict(env)
    if kind == "inproc":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: EngineCore in its own process
    cmd = [sys.executable, "-m", "kvelastic_tools.gpucheck.vllmsmoke", "--attempt", str(model)]
    t = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=ATTEMPT_TIMEOUT[kind])
        result = next((json.loads(line[len(MARK):]) for line in reversed(log.splitlines()) if line.startswith(MARK)),
                      {"ok": False, "error": f"child exited {proc.returncode} without a report"})
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and the engine processes it started
        log, _ = proc.communicate()
        result = {"ok": False, "error": f"timed out after {ATTEMPT_TIMEOUT[kind]} s"}
    result.update(kind=kind, wall_s=round(time.monotonic() - t, 1), returncode=proc.returncode)
    if not result.get("ok"):
        result["log_tail"] = log[-1500:]  # the whole log is in $OUT
    if logs:
        (logs / f"vllmsmoke-{kind}.log").write_text(log)
    return result


def agreement(tokens: list[list[int]] | None, ref: list[list[int]]) -> list[int] | None:
    """For each prompt, how many leading tokens vLLM and plain transformers agree on."""
    if not tokens:
        return None
    counts = []
    for a, b in zip(tokens, ref):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        counts.append(n)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attempt", type=Path, help=argparse.SUPPRESS)  # child mode: the model folder
    args = ap.parse_args(argv)
    if args.attempt:
        manifest = json.loads((BUNDLE / "MANIFEST.json").read_text())
        print(MARK + json.dumps(attempt(args.attempt, manifest["engine_args"])), flush=True)
        return 0
    t0 = time.monotonic()
    report: dict = {"check": "vllm-smoke", "ok": False}
    logs = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    try:
        env, manifest = prepare()
        report["bundle"] = {"vllm": manifest["vllm"]["version"], "zip_bytes": manifest["zip_bytes"],
                            "engine_args": manifest["engine_args"]}
        with tempfile.TemporaryDirectory(prefix="kvelastic-smoke-") as tmp:
            t = time.monotonic()
            model = build_model(Path(tmp))
            report["reference"] = reference(model)
            report["model_build_s"] = round(time.monotonic() - t, 1)
            report["attempts"] = [run_attempt("mp", model, env, logs)]
            if not report["attempts"][0].get("ok"):
                report["attempts"].append(run_attempt("inproc", model, env, logs))
        best = next((a for a in report["attempts"] if a.get("ok")), None)
        report["ok"] = best is not None
        if best:
            report["agree_with_reference"] = agreement(best["tokens"], report["reference"])
            report["distinct_tokens"] = [len(set(t)) for t in best["tokens"]]
    except BaseException as e:  # noqa: BLE001
        report.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    report["wall_s"] = round(time.monotonic() - t0, 1)
    if logs:
        (logs / "vllmsmoke.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
