"""The kit's pieces, each with real processes and real files: a part that hangs
is killed with everything it started, pytest's JUnit XML is read right, the
carried wheels install without pip or network, and the summary says what failed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kvelastic_tools.gpucheck import proc, pytests, report, wheels

ROOT = Path(__file__).resolve().parents[2]


def test_a_part_past_its_budget_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "print('started', flush=True)\n"
              "time.sleep(60)\n")
    started = time.monotonic()
    done = proc.run([sys.executable, "-c", script], 2.0, dict(os.environ), tmp_path, tmp_path / "logs" / "x.log")
    assert done.timed_out and time.monotonic() - started < 15
    assert "started" in done.stdout and "killed after its budget" in done.stderr
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _running(grandchild):
        time.sleep(0.05)
    assert not _running(grandchild), "the part's own child process survived the kill"
    assert "[exit None" in (tmp_path / "logs" / "x.log").read_text()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_last_json_line_is_the_result() -> None:
    done = proc.run([sys.executable, "-c", "print('noise'); print('{\"a\": 1}')"], 30, dict(os.environ), ROOT)
    assert done.returncode == 0 and done.last_json() == {"a": 1}
    bad = proc.run([sys.executable, "-c", "print('no json')"], 30, dict(os.environ), ROOT)
    assert bad.last_json() is None


def test_junit_counts_failures_and_skips_of_a_real_pytest_run(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 + 1 == 3, 'arithmetic'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('fixture')\n"
        "def test_error(broken): pass\n")
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                    str(tmp_path / "test_sample.py")], cwd=tmp_path, capture_output=True, timeout=120)
    result = pytests.junit(xml)
    assert result["counts"] == {"tests": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert {f["kind"] for f in result["failures"]} == {"failure", "error"}
    assert any("arithmetic" in f["text"] for f in result["failures"])
    assert result["skipped"][0]["reason"].endswith("not here")


@pytest.mark.parametrize(("name", "version", "ok"), [
    ("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", (3, 12), True),
    ("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", (3, 13), True),
    ("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", (3, 11), False),
    ("msgspec-0.22.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", (3, 12), True),
    ("msgspec-0.22.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", (3, 11), False),
    ("msgspec-0.22.0-cp312-cp312-manylinux2014_aarch64.whl", (3, 12), False),
    ("pure-1.0-py3-none-any.whl", (3, 11), True),
])
def test_wheel_tags_decide_what_is_installed(name: str, version: tuple[int, int], ok: bool) -> None:
    assert wheels.fits(name, version, "x86_64") is ok


def _fake_wheel(folder: Path, module: str) -> Path:
    wheel = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "VALUE = 42\n")
        zf.writestr(f"{module}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        zf.writestr(f"{module}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{module}-1.0.dist-info/RECORD", "")
    return wheel


def test_carried_wheels_install_into_a_private_folder_only_when_needed(tmp_path: Path, monkeypatch) -> None:
    module = "kvelastic_kit_probe"
    _fake_wheel(tmp_path, module)
    assert wheels.ensure(tmp_path) == (None, [])      # zmq and msgspec are here: nothing to do
    monkeypatch.setattr(wheels, "NEEDED", (module,))
    monkeypatch.setattr(sys, "path", list(sys.path))
    site, notes = wheels.ensure(tmp_path)
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert site == tmp_path / f"site-{tag}" and (site / module / "__init__.py").exists()
    assert notes and str(site) in sys.path
    import importlib

    assert importlib.import_module(module).VALUE == 42
    sys.modules.pop(module, None)


def test_without_wheels_the_error_says_what_to_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(wheels, "NEEDED", ("kvelastic_kit_absent_module",))
    with pytest.raises(wheels.WheelError, match="make gpu-wheels"):
        wheels.ensure(tmp_path)


def test_summary_names_each_failure() -> None:
    rep = {"status": "failed", "seconds": 1.0, "parts": {
        "1": {"status": "failed", "seconds": 1, "counts": {"tests": 2, "passed": 1, "failed": 1, "errors": 0,
                                                           "skipped": 0},
              "failures": [{"test": "tests/vmm/test_cuda.py::test_x", "kind": "failure", "text": "boom\nmore"}]},
        "3": {"status": "failed", "seconds": 1, "checks": [{"name": "bits", "ok": False, "detail": "diff"}],
              "pending": [{"name": "fresh pages", "detail": ""}]},
        "4": {"status": "passed", "seconds": 1, "figures": {"zeroing": {"error": "CudaError: x"}}}},
        "environment": {"date": "d", "backend": "cuda", "device": {"name": "GPU X", "compute_capability": "9.0",
                                                                    "driver_cuda_version": "12.8"},
                        "torch": "t", "torch_cuda": "12.8", "python": "3.12", "cuda_bindings": "12"}}
    text = report.summary(rep)
    assert "FAIL tests/vmm/test_cuda.py::test_x: boom" in text and "FAIL bits: diff" in text
    assert "PENDING fresh pages" in text and "ERROR zeroing: CudaError: x" in text
    assert "device=GPU X" in text and text.endswith("overall: failed (1.0 s)\n")
    assert report.overall(rep["parts"]) == "failed"
