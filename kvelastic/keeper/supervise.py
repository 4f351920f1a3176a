"""``kvelastic keeper --with-daemon``: the keeper with the daemon as its child,
started again whenever it dies: one process tree that keeps the kept cache
through the daemon's crash where nothing else would restart it (a container's
main process: ``docker run`` of the image; the pages live in the keeper, the
container lives as long as the keeper does).

``RestartPolicy`` decides (no clock, no process); ``DaemonChild`` is the
thin shell that starts, watches and stops the process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger("kvelastic.keeper")
CONFIG_ERROR = 2          # the daemon's exit status for a bad setting: no restart fixes it
STOP_TIMEOUT = 25.0       # s: a graceful stop's bound (the DaemonSet grants 30 s in all)


@dataclasses.dataclass
class RestartPolicy:
    """When to start a dead daemon again: after ``first`` seconds, doubling on
    each quick death up to ``most``; a daemon that ran ``steady`` seconds
    earns the short wait again."""
    first: float = 1.0
    most: float = 30.0
    steady: float = 60.0
    delay: float = 0.0

    def died(self, ran_for: float, status: int) -> float | None:
        """Seconds to wait before the next start, or None: give up (a bad setting)."""
        if status == CONFIG_ERROR:
            return None
        self.delay = self.first if ran_for >= self.steady or not self.delay else min(self.most, self.delay * 2)
        return self.delay


class DaemonChild:
    """The daemon as a child process, told to use this keeper and start none."""

    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.due: float | None = 0.0       # when to start it next; None: given up
        self.starts = 0

    def tick(self, now: float) -> bool:
        """Start it when due, note its death; True once it is given up."""
        if self.proc is not None:
            status = self.proc.poll()
            if status is None:
                return False
            self.proc = None
            wait = self.policy.died(now - self.started_at, status)
            if wait is None:
                log.error("the daemon exited with status %d (a configuration error): not started again", status)
                self.due = None
                return True
            log.warning("the daemon exited with status %d after %.1f s: started again in %g s, "
                        "its pages kept", status, now - self.started_at, wait)
            self.due = now + wait
        if self.due is not None and now >= self.due:
            env = dict(os.environ, KVELASTIC_KEEPER="external")
            self.proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=env)
            self.started_at, self.starts = now, self.starts + 1
            log.info("started the daemon (pid %d, start %d)", self.proc.pid, self.starts)
        return self.due is None

    def stop(self) -> int:
        """SIGTERM, then SIGKILL past ``STOP_TIMEOUT``; the daemon's exit status (0: not running)."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            log.warning("the daemon did not stop within %g s: killed", STOP_TIMEOUT)
            self.proc.kill()
            return self.proc.wait()
