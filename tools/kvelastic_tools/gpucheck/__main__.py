"""``python -m kvelastic_tools.gpucheck`` -- what ``make gpu-check`` runs.

Runs the five parts one after the other, each in its own process group with
its own wall-clock budget (``BUDGETS``, under 8 minutes in all, so one call on
a device with a 10-minute limit always comes back with a report), then writes
``gpu-report.json`` and ``summary.txt`` to ``$OUT`` (else ``./gpu-report``),
with each part's full output under ``logs/``. Exit status 1 when a part
failed.

Environment: ``KVELASTIC_BACKEND`` = ``cuda`` (a GPU is required: its absence
is a failure), ``host`` (parts 2-3 on host pages, parts 1 and 4 report "no
GPU", part 5 is not run unless named), or ``auto``/unset (cuda when usable).
Part 5 runs real vLLM: the bundle ``make gpu-wheels`` carries
(``.gpu-wheels/vllm``), else whatever vLLM imports. ``KVELASTIC_GPUCHECK_PARTS`` =
e.g. ``1,3`` runs only those parts (to re-run what failed, cheaply);
``KVELASTIC_GPUCHECK_FLOWS`` = pytest node ids, comma-separated, runs those
in part 2 instead of ``pytests.FLOW_TESTS``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import kvelastic
from kvelastic_tools.gpucheck import proc, pytests, report, wheels

# Seconds; 480 in all. On an H200 (2026-12-04) parts 1-4 took 12, 97, 19 and 10 s.
BUDGETS = {"1": 60.0, "2": 150.0, "3": 45.0, "4": 60.0, "5": 165.0}


def part3(backend: str, budget: float, env: dict[str, str], root: Path, work: Path) -> dict[str, Any]:
    done = proc.run([sys.executable, "-m", "kvelastic_tools.gpucheck.kvcheck", backend], budget, env, root,
                    work / "logs" / "part3.log")
    result = done.last_json()
    if result is None:
        why = "timed out" if done.timed_out else f"exited {done.returncode} without a result"
        return {"status": "failed", "seconds": done.seconds, "checks": [],
                "failures": [{"test": "(run)", "kind": "error", "text": f"{why}\n{done.tail()}"}]}
    ok = all(c["ok"] for c in result["checks"]) and bool(result["checks"]) and done.returncode == 0
    return {"status": "passed" if ok else "failed", "seconds": done.seconds, "checks": result["checks"],
            "pending": result["pending"], "figures": result["figures"], "failures": []}


def part5(backend: str, budget: float, env: dict[str, str], root: Path, work: Path, wheels_dir: Path,
          asked: bool) -> dict[str, Any]:
    """Real vLLM through the daemon (``vllmpart``), with the carried bundle
    when there is one. On host pages only when asked for by name
    (``KVELASTIC_GPUCHECK_PARTS=5``): the suite runs vLLM on host pages itself."""
    bundle = wheels_dir / "vllm"
    if backend != "cuda" and not asked:
        return {"status": "not run", "seconds": 0,
                "notes": ["host pages: the suite's tests/vllm run vLLM here; KVELASTIC_GPUCHECK_PARTS=5 rehearses"]}
    argv = [sys.executable, "-m", "kvelastic_tools.gpucheck.vllmpart", "--budget", f"{budget - 10:.0f}"]
    if bundle.is_dir():
        argv += ["--bundle", str(bundle)]
    done = proc.run(argv, budget, {**env, "KVELASTIC_BACKEND": backend}, root, work / "logs" / "part5.log")
    result = done.last_json()
    if result is None:
        why = "timed out" if done.timed_out else f"exited {done.returncode} without a result"
        return {"status": "failed", "seconds": done.seconds,
                "failures": [{"test": "(run)", "kind": "error", "text": f"{why}\n{done.tail()}"}]}
    failures = [{"test": "(vllm)", "kind": "error", "text": p} for p in result.get("problems", [])]
    if result.get("error"):
        failures.append({"test": "(vllm)", "kind": "error", "text": result["error"]})
    return {"status": "passed" if result.get("status") == "passed" else "failed", "seconds": done.seconds,
            "figures": result, "failures": failures,
            "notes": [] if bundle.is_dir() else [f"no bundle at {bundle}: the vLLM that imports here"]}


def part4(backend: str, budget: float, env: dict[str, str], root: Path, work: Path, why_no_gpu: str
          ) -> dict[str, Any]:
    done = proc.run([sys.executable, "-m", "kvelastic_tools.gpucheck.cudabench", backend], budget, env, root,
                    work / "logs" / "part4.log")
    figures = done.last_json()
    if figures is None:
        why = "timed out" if done.timed_out else f"exited {done.returncode} without figures"
        return {"status": "failed", "seconds": done.seconds,
                "failures": [{"test": "(run)", "kind": "error", "text": f"{why}\n{done.tail()}"}]}
    errors = [f"{k}: {v['error']}" for k, v in figures.items() if isinstance(v, dict) and "error" in v]
    if not (figures.get("zeroing") or {}).get("zeroed", False) and "zeroing" not in " ".join(errors):
        errors.append("zeroing: the backend's zero left non-zero bytes")
    if (figures.get("tier") or {}).get("whole") is False:
        errors.append("tier: bytes demoted to host memory and promoted back did not come back whole")
    part: dict[str, Any] = {"seconds": done.seconds, "figures": figures,
                            "failures": [{"test": "(bench)", "kind": "error", "text": e} for e in errors]}
    if errors:
        part["status"] = "failed"
    elif backend != "cuda":
        part["status"] = "no GPU"
        part["notes"] = [f"no CUDA figures: {why_no_gpu}; the figures are a smoke run on host pages"]
    else:
        part["status"] = "passed"
    return part


def choose_backend() -> tuple[str, bool, str]:
    """(backend, CUDA usable, why) from ``KVELASTIC_BACKEND``."""
    from kvelastic.vmm import cuda_usable

    requested = os.environ.get("KVELASTIC_BACKEND", "auto") or "auto"
    if requested not in ("auto", "cuda", "host"):
        raise SystemExit(f"gpu-check: KVELASTIC_BACKEND={requested!r}: choose auto, cuda or host")
    usable, why = cuda_usable()
    backend = ("cuda" if usable else "host") if requested == "auto" else requested
    return backend, usable, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvelastic_tools.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default=".gpu-wheels", help="folder of carried wheels (make gpu-wheels)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    root = Path(kvelastic.__file__).resolve().parents[1]
    out = Path(os.environ.get("OUT") or Path.cwd() / "gpu-report")
    notes: list[str] = []
    env = dict(os.environ)
    path = [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        site, notes = wheels.ensure(Path(args.wheels).resolve())
    except wheels.WheelError as exc:
        site = None
        notes.append(str(exc))
    if site is not None:
        path.insert(1, str(site))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    env.setdefault("PYTHONUNBUFFERED", "1")

    backend, usable, why = choose_backend()
    asked = os.environ.get("KVELASTIC_GPUCHECK_PARTS", "")
    selected = [p.strip() for p in (asked or ",".join(BUDGETS)).split(",") if p.strip()]
    parts: dict[str, dict[str, Any]] = {}
    missing = wheels.missing()
    for key in BUDGETS:
        if key not in selected:
            parts[key] = {"status": "not run", "seconds": 0, "notes": ["not in KVELASTIC_GPUCHECK_PARTS"]}
        elif missing:
            parts[key] = {"status": "failed", "seconds": 0, "failures": [
                {"test": "(setup)", "kind": "error", "text": f"{', '.join(missing)} not importable: {notes}"}]}
        elif backend == "cuda" and not usable:
            parts[key] = {"status": "failed", "seconds": 0, "failures": [
                {"test": "(setup)", "kind": "error", "text": f"KVELASTIC_BACKEND=cuda but no usable GPU: {why}"}]}
        elif not (root / "tests").is_dir() and key in ("1", "2"):
            parts[key] = {"status": "failed", "seconds": 0, "failures": [
                {"test": "(setup)", "kind": "error", "text": f"no tests/ folder next to the package in {root}"}]}
        else:
            budget = BUDGETS[key]
            print(f"gpu-check: part {key} ({report.TITLES[key]}) on {backend}, budget {budget:.0f} s ...",
                  flush=True)
            if key == "1":
                parts[key] = pytests.part1(backend, budget, env, root, out, why)
            elif key == "2":
                parts[key] = pytests.part2(backend, budget, env, root, out)
            elif key == "3":
                parts[key] = part3(backend, budget, env, root, out)
            elif key == "4":
                parts[key] = part4(backend, budget, env, root, out, why)
            else:
                parts[key] = part5(backend, budget, env, root, out, Path(args.wheels).resolve(), "5" in asked)
        parts[key]["title"] = report.TITLES[key]
    result = {
        "kit": "kvelastic gpu-check",
        "status": report.overall(parts),
        "seconds": round(time.monotonic() - started, 1),
        "environment": report.environment(backend),
        "parts": parts,
        "notes": notes,
    }
    json_path, text_path = report.write(result, out)
    sys.stdout.write(text_path.read_text())
    print(f"gpu-check: report in {json_path} and {text_path}", flush=True)
    return 1 if result["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
