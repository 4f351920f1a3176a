"""Run one part of the kit in its own process group, under its own wall-clock budget.

Why a process group: a part starts daemons and engine processes of its own;
when it overruns, killing the group takes them all, so one hung part cannot
eat the device's 10-minute command limit or leave a process holding GPU memory
while the next part runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

LOG_LIMIT = 1 << 20  # bytes of each part's output kept in the logs folder


@dataclasses.dataclass
class Finished:
    returncode: int | None        # None: killed at its budget
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, chars: int = 3000) -> str:
        text = (self.stdout + ("\n" if self.stdout and self.stderr else "") + self.stderr).strip()
        return text[-chars:]

    def last_json(self) -> dict[str, Any] | None:
        """The JSON object on the last non-empty stdout line, if there is one."""
        for line in reversed(self.stdout.splitlines()):
            if line.strip():
                try:
                    value = json.loads(line)
                except ValueError:
                    return None
                return value if isinstance(value, dict) else None
        return None


def run(cmd: list[str], budget: float, env: dict[str, str], cwd: Path, log: Path | None = None) -> Finished:
    """Run ``cmd`` to completion or to ``budget`` seconds, then kill its whole group."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=budget)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        code = None
        err += f"\n[gpu-check] killed after its budget of {budget:.0f} s"
    _kill_group(proc)  # what the part left behind (a daemon it failed to stop)
    done = Finished(code, out or "", err or "", round(time.monotonic() - started, 2))
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        text = (f"$ {' '.join(cmd)}\n[exit {code}, {done.seconds} s]\n"
                f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
        log.write_text(text[-LOG_LIMIT:])
    return done


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(10)
