"""The tests' fork server (``zygote.py``): a command forked from it behaves as
the same command run as a plain subprocess, and a command whose environment
could change its imports is run as a plain subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.vllm import zygote

pytest.importorskip("vllm")

SCRIPT = """
import os, sys
print("ENV", os.environ.get("KVELASTIC_PROBE"), os.getcwd() == {cwd!r}, flush=True)
print("ECHO", sys.stdin.readline().strip(), flush=True)
print("ERR", file=sys.stderr)
print("ARGV", sys.argv[1:])
print("PRELOADED", "vllm.entrypoints.openai.api_server" in sys.modules)
print("PATH", [p for p in sys.path if p.endswith("elsewhere")])
if sys.argv[1] == "raise":
    raise ValueError("from the script")
if __name__ == "__main__":
    sys.exit(int(sys.argv[1]))
"""


FORMS = ("forked", "script", "code")


def _argv(form: str, tmp_path) -> list[str]:
    code = SCRIPT.format(cwd=str(tmp_path))
    script = tmp_path / "probe.py"
    script.write_text(code)
    return {"forked": [sys.executable, "-m", "tests.vllm.forked", str(script)], "script": [sys.executable, str(script)],
            "code": [sys.executable, "-c", code]}[form]


def _run(tmp_path, monkeypatch, *args: str, plain: bool, form: str = "forked",
         **env: str) -> tuple[object, str, str, int]:
    argv = _argv(form, tmp_path)
    # The repository, from the test's folder: a PYTHONPATH the server did not
    # start with, put on the forked child's sys.path as Python would.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(zygote.ROOT), str(tmp_path / "elsewhere")]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVELASTIC_TEST_ZYGOTE", "0" if plain else "1")
    proc = zygote.launch([*argv, *args],
                         env={**os.environ, "KVELASTIC_PROBE": "seen", **env}, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write("hello\n")
    proc.stdin.close()
    out, err = proc.stdout.read(), proc.stderr.read()
    return proc, out, err, proc.wait(timeout=120)


@pytest.mark.parametrize("form", FORMS)
def test_a_forked_command_behaves_as_a_plain_one(tmp_path, monkeypatch, form):
    forked, out, err, code = _run(tmp_path, monkeypatch, "3", plain=False, form=form)
    plain, plain_out, plain_err, plain_code = _run(tmp_path, monkeypatch, "3", plain=True, form=form)
    assert isinstance(forked, zygote.ForkedProcess), zygote._client.log
    assert isinstance(plain, subprocess.Popen)
    assert code == plain_code == 3
    assert out.replace("PRELOADED True", "PRELOADED False") == plain_out          # the one difference: imports
    assert "ENV seen True" in out and "ECHO hello" in out and "ARGV ['3']" in out and "elsewhere']" in out, out
    assert err == plain_err == "ERR\n"
    assert forked.poll() == 3 and forked.returncode == 3


def test_a_failing_command_exits_1_with_its_traceback(tmp_path, monkeypatch):
    _, _, err, code = _run(tmp_path, monkeypatch, "raise", plain=False)
    assert code == 1
    assert "ValueError: from the script" in err and "Traceback" in err


def test_an_environment_read_at_import_runs_a_plain_subprocess(tmp_path, monkeypatch):
    proc, out, _, code = _run(tmp_path, monkeypatch, "0", plain=False, OMP_NUM_THREADS="7")
    assert isinstance(proc, subprocess.Popen) and code == 0
    assert "PRELOADED False" in out
    assert zygote._client.why_not([sys.executable, "-m", "tests.vllm.forked", "x"],
                                  {**os.environ, "OMP_NUM_THREADS": "7"}) == "OMP_NUM_THREADS differs"
    assert zygote._client.why_not([sys.executable, "-u", "x.py"], dict(os.environ)) == \
        "not a script, -c or forked.py command"


def test_signals_reach_the_forked_command_in_its_own_session(tmp_path, monkeypatch):
    script = tmp_path / "sleeper.py"
    script.write_text("import sys, time\nprint('UP', flush=True)\ntime.sleep(600)\n")
    proc = zygote.launch([sys.executable, "-m", "tests.vllm.forked", str(script)], env=dict(os.environ),
                         stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert isinstance(proc, zygote.ForkedProcess), zygote._client.log
        assert proc.stdout.readline() == b"UP\n"
        assert os.getpgid(proc.pid) == proc.pid and proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()                                     # ended: nothing to signal, and no error
