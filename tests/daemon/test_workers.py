"""Two workers of one engine on one device, each its own process: the shape of
tensor parallelism (vLLM runs one worker process per rank). Every rank maps its
own pages of each slab, a slab is granted only once both mapped it, and a
return or the death of one rank gives the pages of both back."""

from tests.daemon.books import SLAB, held
from tests.daemon_proc import wait_for

TP_SLAB = 2 * SLAB  # one page per rank


def test_two_workers_of_one_engine_map_and_let_go_of_their_own_pages(daemon, engines):
    e = engines(daemon, "tp", workers=2, ranks=[], grace=0.3)
    w0 = engines(daemon, "tp", role="worker", rank=0)
    w1 = engines(daemon, "tp", role="worker", rank=1)
    assert e.do("ensure", n=8)["ok"]                               # 2 slabs of 4 blocks
    e.do("alloc", n=8)                                             # live: not returned while the ranks write
    assert held(daemon, "tp") == 2 * TP_SLAB
    assert daemon.status()["pages"]["created"] == 4                # 2 slabs x 2 ranks
    assert w0.state()["mapped"] == 2 and w1.state()["mapped"] == 2
    assert w0.do("write", value=11)["values"] == [11, 11]
    assert w1.do("write", value=22)["values"] == [22, 22]
    assert w0.do("read")["values"] == [11, 11]                     # each rank has pages of its own

    e.do("free")                                                   # idle: both slabs go back
    wait_for(lambda: held(daemon, "tp") == 0, timeout=5, what="idle slabs returned")
    assert w0.state()["mapped"] == 0 and w1.state()["mapped"] == 0
    assert daemon.status()["memory"]["free"] == 2 * TP_SLAB

    assert e.do("ensure", n=4)["ok"]                               # reused pages, both ranks map again
    assert w0.state()["mapped"] == 1 and w1.state()["mapped"] == 1
    assert daemon.status()["pages"]["created"] == 4
    w1.kill()                                                      # one rank dies: the engine is gone

    def registration_gone() -> bool:
        # Its lifeline closed, the engine process (still alive) may register
        # again at once: a new registration, no rank of it registered, nothing held.
        status = daemon.status()
        tp = [e for e in status["engines"] if e["engine_id"] == "tp"]
        return status["memory"]["held"] == 0 and all(e["workers"] == 0 and e["held_bytes"] == 0 for e in tp)

    try:
        wait_for(registration_gone, timeout=2.0, what="the engine's slabs back after a rank died")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nstatus: {daemon.status()}\nw0: {w0.state()}\n"
                             f"daemon log:\n{daemon.log()[-4000:]}") from None
    wait_for(lambda: w0.state()["mapped"] == 0, timeout=2.0, what="the surviving rank unmapped")
    memory = daemon.status()["memory"]                             # nothing held, nothing leaked
    assert memory["held"] == 0 and memory["free"] + memory["unallocated"] == daemon.status()["budget_bytes"]
