"""Parts 1 and 2: the repository's own tests, run by pytest in a subprocess.

Why the tests and not a copy: the CUDA backend's tests (``-m gpu``) and the
daemon flow tests already state what must hold; the kit runs them on the
device and reads pytest's JUnit XML (robust, unlike parsing its console
summary). The flow tests take their backend from ``KVELASTIC_TEST_BACKEND``
(``tests/backend.py``), so the same tests prove host and CUDA pages.

On a GPU a skipped test counts as a failure: a skip there means something did
not run (a CPU-only torch, a missing driver feature), and the report must not
say "passed" for it.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from kvelastic_tools.gpucheck import proc

# Part 2: the flows the issue names, on the backend under test.
FLOW_TESTS = [
    "tests/daemon/test_flows.py",                   # grow, shrink, reclaim, live never reclaimed, limits, zeroing
    "tests/daemon/test_failures.py::test_kill_9_of_an_engine_returns_its_memory_within_2_s",
    "tests/daemon/test_failures.py::test_daemon_kill_9_and_restart",   # restart with adoption
    "tests/daemon/test_workers.py",                 # two workers of one engine on one device
    "tests/daemon/test_safe_point.py",              # no unmap while a step runs (device sync first)
    # Warm restarts: the kept cache across the daemon's kill -9 and SIGTERM, its pages held by the keeper
    # (on CUDA: exported handles, imported again by the next daemon and mapped by the next engine).
    "tests/daemon/test_keeper_daemon.py::test_the_kept_cache_survives_the_daemon",
]
FAILURE_TEXT = 2000  # characters of each failure kept in the report


def flow_tests(env: dict[str, str]) -> list[str]:
    """Part 2's tests: ``FLOW_TESTS``, or the pytest node ids (comma-separated)
    in ``KVELASTIC_GPUCHECK_FLOWS``: to re-run one failed flow cheaply, and for
    the suite's end-to-end run of the kit (``tests/gpucheck/test_kit.py``),
    whose host flows the suite runs itself."""
    chosen = [t.strip() for t in env.get("KVELASTIC_GPUCHECK_FLOWS", "").split(",") if t.strip()]
    return chosen or list(FLOW_TESTS)


def junit(path: Path) -> dict[str, Any]:
    """Counts, failures (name and text, truncated) and skip reasons from a JUnit XML file."""
    root = ET.parse(path).getroot()
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                text = (child.get("message", "") + "\n" + (child.text or "")).strip()
                failures.append({"test": name, "kind": child.tag, "text": text[-FAILURE_TEXT:]})
            elif child.tag == "skipped":
                outcome = "skipped"
                skipped.append({"test": name, "reason": child.get("message", "")[:300]})
        counts[outcome] += 1
    return {"counts": counts, "failures": failures, "skipped": skipped}


def _pytest(args: list[str], budget: float, env: dict[str, str], root: Path, work: Path, name: str) -> tuple[
        proc.Finished, dict[str, Any] | None]:
    xml = work / f"{name}.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
    done = proc.run(cmd, budget, env, root, work / "logs" / f"{name}.log")
    return done, junit(xml) if xml.exists() else None


def _verdict(done: proc.Finished, result: dict[str, Any] | None, gpu: bool) -> dict[str, Any]:
    part: dict[str, Any] = {"seconds": done.seconds}
    if result is None:
        why = "timed out" if done.timed_out else f"pytest exited {done.returncode} without a report"
        part.update(status="failed", counts={}, failures=[{"test": "(run)", "kind": "error",
                                                           "text": f"{why}\n{done.tail()}"}])
        return part
    counts = result["counts"]
    part.update(counts=counts, failures=result["failures"], skipped=result["skipped"])
    bad = counts["failed"] or counts["errors"] or not counts["passed"] or done.timed_out \
        or (gpu and counts["skipped"])
    if done.timed_out:
        part["failures"].append({"test": "(run)", "kind": "error", "text": "timed out\n" + done.tail()})
    if gpu and counts["skipped"]:
        part["failures"].append({"test": "(skips)", "kind": "error",
                                 "text": "tests skipped on a GPU machine: " + "; ".join(
                                     f"{s['test']}: {s['reason']}" for s in result["skipped"])[:FAILURE_TEXT]})
    part["status"] = "failed" if bad else "passed"
    return part


def part1(backend: str, budget: float, env: dict[str, str], root: Path, work: Path, why_no_gpu: str) -> dict[str, Any]:
    """The CUDA backend's tests; without a GPU only collected, to show they still import."""
    if backend != "cuda":
        done = proc.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                         "-m", "gpu", "tests/vmm"], budget, env, root, work / "logs" / "part1.log")
        collected = [line for line in done.stdout.splitlines() if "::" in line]
        if done.returncode != 0 or not collected:
            return {"status": "failed", "seconds": done.seconds, "counts": {"collected": len(collected)},
                    "failures": [{"test": "(collect)", "kind": "error", "text": done.tail()}]}
        return {"status": "no GPU", "seconds": done.seconds, "counts": {"collected": len(collected)},
                "notes": [f"not run: {why_no_gpu}; the {len(collected)} GPU tests were collected"]}
    done, result = _pytest(["-m", "gpu", "tests/vmm"], budget, env, root, work, "part1")
    return _verdict(done, result, gpu=True)


def part2(backend: str, budget: float, env: dict[str, str], root: Path, work: Path) -> dict[str, Any]:
    """The daemon's flows with real engine and worker processes on the backend's pages."""
    tests = flow_tests(env)
    env = dict(env, KVELASTIC_TEST_BACKEND=backend)
    done, result = _pytest(tests, budget, env, root, work, "part2")
    verdict = _verdict(done, result, gpu=backend == "cuda")
    verdict["tests"] = tests
    return verdict
