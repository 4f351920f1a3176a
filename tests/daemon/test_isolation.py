"""No tenant sees another tenant's memory, even through a worker that lies.

A page that moves to another engine is a fresh physical page (invariant 6):
a worker that acknowledges an unmap but keeps the mapping sees only what its
own engine wrote, and the engine that gets the memory next starts from zeros.
(Found on an earlier daemon, which zeroed pages and lent the same memory on:
the stale mapping read the next tenant's data, and could write into it.)
"""

from tests.daemon.hostile import Driver
from tests.daemon.test_flows import held
from tests.daemon_proc import wait_for


def test_a_stale_mapping_never_shows_the_next_tenants_data(daemon_factory, tmp_path):
    daemon = daemon_factory(memory="8MiB")                                # 4 pages
    a = Driver(daemon.socket, "a", namespace="tenant-a", keep_mappings=True, grace=0.2)
    b = Driver(daemon.socket, "b", namespace="tenant-b", grace=60)
    try:
        assert a.do("ensure", n=16)["ok"]                                 # the whole budget
        assert a.do("write", value=0xA1)["values"] == [0xA1] * 4
        wait_for(lambda: held(daemon, "a") == 0, timeout=5, what="a's idle slabs returned")
        assert b.do("ensure", n=16)["ok"]                                 # the same budget, now b's
        assert b.do("read")["values"] == [0] * 4                          # nothing of a's KV
        assert b.do("write", value=0xB2)["values"] == [0xB2] * 4          # b's secret
        assert a.do("read_stale")["values"] == [0xA1] * 4                 # a still sees only its own bytes
        assert b.do("read")["values"] == [0xB2] * 4
    finally:
        a.close()
        b.close()
