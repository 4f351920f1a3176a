"""A stalled engine is not a dead one: a process that stops heartbeating
(SIGSTOP: a machine-wide stall, a long GC pause) while its lifeline stays open
keeps its memory. Unmapping pages under a live vLLM worker crashes it."""

import os
import signal
import time

from kvelastic import protocol as p
from tests.daemon_proc import wait_for


def engine_status(daemon, engine_id):
    return next((e for e in daemon.request(p.Status()).status.engines if e.engine_id == engine_id), None)


def test_an_engine_that_stalls_past_the_heartbeat_timeout_keeps_its_memory(daemon_factory, engines):
    daemon = daemon_factory(memory="8MiB")
    a = engines(daemon, "a", grace=60)
    assert a.do("ensure", n=8)["ok"]
    a.do("alloc", n=8)
    assert a.do("write", value=3)["values"] == [3, 3]
    os.kill(a.proc.pid, signal.SIGSTOP)                      # engine and worker stop: no heartbeat
    try:
        time.sleep(3 * p.HEARTBEAT_TIMEOUT)
        e = engine_status(daemon, "a")
        assert e is not None and e.slabs == 2, daemon.log()[-2000:]
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    out = a.do("read")
    assert out["values"] == [3, 3] and out["state"]["mapped"] == 2
    assert "process is alive (lifeline open): kept" in daemon.log()
    wait_for(lambda: "heartbeats again" in daemon.log(), what="the engine heartbeats again")
    a.kill()                                                 # a real death still returns the memory
    wait_for(lambda: engine_status(daemon, "a") is None, what="the dead engine dropped")
