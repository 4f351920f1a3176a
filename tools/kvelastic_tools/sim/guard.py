"""Every allocator call the simulator makes is timed: no call may do work out
of proportion to its input, whatever numbers a hostile client declared
(``hostile.py``). A call that takes more than ``CALL_LIMIT`` seconds of CPU
is a violation.

Calls are timed by the wall clock (cheap) and a slow one is confirmed by
the process's CPU time, less the time the garbage collector ran (a full
collection of a long test process's heap can land inside any call), so
neither a descheduled process nor the collector is blamed. While a
hostile registration is on the books a watchdog (``ITIMER_PROF``, the main
thread only) interrupts a call at the limit instead: a walk over 2**40
block ids must be reported, not hang the run. An interrupted call leaves
the books half-changed, so the run ends there (``SimAbort``).
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

CALL_LIMIT = 0.2     # seconds of CPU one allocator call may take


class CallOverrun(BaseException):
    """Raised by the watchdog inside a call that ran past the limit (a
    ``BaseException``: no handler in the allocator may swallow it)."""


class SimAbort(Exception):
    """The run cannot go on (a call was interrupted half-way)."""


def describe(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    name = getattr(fn, "__name__", "call")
    if name == "handle" and len(args) > 1:
        msg = args[1]
        return f"{type(msg).__name__} from engine {getattr(msg, 'engine_id', '-')}"
    return name


class CallGuard:
    def __init__(self, violation: Callable[[str], None]) -> None:
        self.violation = violation
        self.watch = False         # the watchdog interrupts runaway calls (a hostile client is about)
        self.available = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        self.cpu_mark = time.process_time()
        self._in_call = False
        self._old: Any = None
        self._installed = False
        self._gc_cpu = 0.0          # CPU seconds the collector ran, in all
        self._gc_start = 0.0
        gc.callbacks.append(self._collecting)

    def _collecting(self, phase: str, info: dict[str, int]) -> None:
        now = time.process_time()
        if phase == "start":
            self._gc_start = now
        else:
            self._gc_cpu += now - self._gc_start

    def _cpu(self) -> float:
        """The process's CPU time without the collector's."""
        return time.process_time() - self._gc_cpu

    def mark(self) -> None:
        """A recent point of the process's CPU clock: a slow call is confirmed against it."""
        self.cpu_mark = self._cpu()

    def slow(self, fn: Callable[..., Any], args: tuple[Any, ...], wall: float) -> None:
        """A call took long by the clock (``World.call`` times each one): a
        violation if the CPU says so too."""
        cpu = self._cpu() - self.cpu_mark
        if cpu > CALL_LIMIT:
            self.violation(f"allocator: {describe(fn, args)} took {wall:.2f} s ({cpu:.2f} s of CPU since the "
                           f"last mark): more than {CALL_LIMIT} s for one call")

    def watched(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self.available and not self._installed:
            self._old = signal.signal(signal.SIGPROF, self._overrun)
            self._installed = True
        start = self._cpu()
        self._in_call = True
        if self.available:
            signal.setitimer(signal.ITIMER_PROF, CALL_LIMIT, 0.02)
        try:
            out = fn(*args)
        except CallOverrun:
            self.violation(f"allocator: {describe(fn, args)} interrupted after {CALL_LIMIT} s of CPU: work out "
                           f"of proportion to its input (a hostile number walked?)")
            raise SimAbort(describe(fn, args)) from None
        finally:
            if self.available:
                signal.setitimer(signal.ITIMER_PROF, 0)
            self._in_call = False
        cpu = self._cpu() - start
        if cpu > CALL_LIMIT:
            self.violation(f"allocator: {describe(fn, args)} took {cpu:.2f} s of CPU: more than {CALL_LIMIT} s "
                           f"for one call")
        return out

    def _overrun(self, signum: int, frame: Any) -> None:
        if self._in_call:
            raise CallOverrun()

    def close(self) -> None:
        """Put back whatever handled SIGPROF before, and stop hearing the collector."""
        if self._collecting in gc.callbacks:
            gc.callbacks.remove(self._collecting)
        if self._installed:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, self._old if self._old is not None else signal.SIG_DFL)
            self._installed = False
