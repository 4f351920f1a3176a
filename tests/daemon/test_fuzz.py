"""The structure-aware fuzzer (``kvelastic.fuzz``) against a real daemon
(Step 7): no frame or page-channel connection crashes it, hangs it, or grows
it, every refusal is counted, and a legitimate engine beside the fuzz keeps
its slabs, its data and its status, and still grows, serves and shrinks."""

import collections
import os

import msgspec
import pytest

from kvelastic import fuzz
from kvelastic import protocol as p
from kvelastic.bench import fuzzdrive as fd
from kvelastic.bench.daemon import fd_count, rss_bytes
from kvelastic.daemon.server import _UNDECODABLE
from kvelastic.fuzzvalues import ValueBuilder
from tests.daemon.hostile import Driver, rejected_total
from tests.daemon_proc import wait_for

MiB = 1 << 20
LEGIT = "fuzz-legitimate-engine"
NAMESPACE = "fuzz-legitimate-namespace"
FRAMES = 20_000
CHANNELS = 600
PAGE = 2 * MiB


def _decodes(data: bytes) -> bool:
    try:
        p.decode(data)
        return True
    except _UNDECODABLE:
        return False


def _has_extreme(data: bytes) -> bool:
    """Does a frame hold an integer at a boundary (or past 64 bits, as a float or ext)?"""
    def walk(x) -> bool:
        if isinstance(x, dict):
            return any(walk(k) or walk(v) for k, v in x.items())
        if isinstance(x, list):
            return any(walk(v) for v in x)
        return isinstance(x, (float, msgspec.msgpack.Ext)) or (isinstance(x, int) and not isinstance(x, bool)
                                                              and (x < 0 or x >= 2**31))
    try:
        return walk(msgspec.msgpack.decode(data))
    except msgspec.DecodeError:
        return False


def test_the_generator_covers_every_message_type_and_every_kind():
    fz = fuzz.Fuzzer(7)
    assert {t.__name__ for t in fuzz.MESSAGE_TYPES} == {t.__name__ for t in p.Message.__args__}
    for cls in fuzz.MESSAGE_TYPES:            # valid instances, built only from type information
        for _ in range(20):
            assert type(p.decode(fz.valid(cls))) is cls
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for kind in fuzz.KINDS:
        for cls in fuzz.MESSAGE_TYPES:
            got, parts = fz.frame(kind, cls)
            assert got == kind and parts
            if kind == "oversize":
                assert len(parts[0]) > p.MAX_MESSAGE_BYTES
            elif kind == "multi_frame":
                assert 2 <= len(parts) <= 4
            else:
                assert len(parts) == 1 and len(parts[0]) <= p.MAX_MESSAGE_BYTES
                outcomes[kind]["decodes" if _decodes(parts[0]) else "refused"] += 1
            if kind == "deep_nesting":
                assert any(level * 1000 in parts[0] for level in fuzz.NESTING), "1,000+ levels of nesting"
            if kind == "invalid_utf8":
                assert any(bad in parts[0] for bad in fuzz.INVALID_UTF8)
            if kind == "boundary_int":
                outcomes["extreme"][_has_extreme(parts[0])] += 1
    assert outcomes["valid"]["refused"] == 0
    assert outcomes["extreme"][True] >= len(fuzz.MESSAGE_TYPES) / 2, outcomes["extreme"]
    for kind in ("truncated", "deep_nesting", "wrong_type", "invalid_utf8"):
        assert outcomes[kind]["refused"] >= len(fuzz.MESSAGE_TYPES) * 0.75, (kind, outcomes[kind])
    # every kind turns up in the weighted mix, and a seed replays the same frames
    mix = collections.Counter(fz.frame()[0] for _ in range(5000))
    assert set(mix) >= set(fuzz.KINDS) - {"oversize"}          # 1 in 1,000: an oversize frame costs 1-2 MiB
    a, b = fuzz.Fuzzer(11), fuzz.Fuzzer(11)
    assert [a.frame() for _ in range(300)] == [b.frame() for _ in range(300)]
    for kind in fuzz.CHANNEL_KINDS:
        assert fz.channel(kind)[0] == kind
    body = fz.channel("valid_then_close")[1].first
    hello = msgspec.msgpack.decode(body[4:], type=p.Hello)
    assert int.from_bytes(body[:4], "little") == len(body) - 4 and hello.version == p.PROTOCOL_VERSION
    assert int.from_bytes(fz.channel("huge_size")[1].first[:4], "little") > 4096
    # hints (a registration this daemon accepts) name only fields the protocol has, and stay valid
    hinted = fuzz.Fuzzer(3, hints=fuzz.daemon_hints(PAGE, os.getpid()))
    built = [p.decode(hinted.valid(p.RegisterEngine)) for _ in range(200)]
    assert sum(m.page_size == PAGE and m.version == p.PROTOCOL_VERSION for m in built) > 50


def test_names_the_fuzzer_must_avoid_are_never_generated():
    fz = fuzz.Fuzzer(1, avoid=("ab",))
    builder = ValueBuilder(fz.rng, fz.avoid, {})
    assert "ab" not in {builder._name(2, 2) for _ in range(5000)}


@pytest.mark.slow
def test_a_fuzzed_daemon_lives_counts_and_keeps_its_engine(daemon):
    # min_bytes: the fuzz registers engines of its own, whose grows must not reclaim from this one
    legit = Driver(daemon.socket, LEGIT, namespace=NAMESPACE, keep_idle=0, grace=3.0, min_bytes=2 * PAGE)
    try:
        assert legit.do("ensure", n=8)["ok"]                     # 2 slabs of 4 blocks, all in use: kept
        assert legit.do("alloc", n=8)["state"]["live"] == 8
        assert legit.do("write", value=7)["values"] == [7, 7]
        before = wait_for(lambda: (e := _engine(daemon))["live_blocks"] == 8 and e, what="the journal shipped")
        pid = daemon.proc.pid
        rss0, fds0, rejected0 = rss_bytes(pid), fd_count(pid), rejected_total(daemon)

        fuzzer = fuzz.Fuzzer(2024, (LEGIT, NAMESPACE), hints=fuzz.daemon_hints(PAGE, os.getpid()))
        channel_fuzzer = fuzz.Fuzzer(2025, (LEGIT, NAMESPACE))
        alive = lambda: daemon.proc.poll() is None               # noqa: E731
        join = fd.in_background(fd.channel_fuzz, daemon.socket, channel_fuzzer, CHANNELS)
        flood = fd.Flood(daemon.socket, alive=alive, pid=pid).run(fd.frames(fuzzer), FRAMES, 2_000)
        connections = join()
        assert flood.crashed_after is None and alive(), daemon.log()[-3000:]
        assert flood.frames == FRAMES and set(flood.by_kind) == set(fuzz.KINDS), flood.by_kind
        assert not flood.hangs and max(flood.probes) < fd.PROBE_TIMEOUT, flood.hangs
        assert flood.errors[p.Reason.INTERNAL.value] == 0 and "Traceback" not in daemon.log()

        assert sum(connections.values()) - connections["send_failed"] == CHANNELS
        assert fd.stalled_hellos(daemon.socket, channel_fuzzer, 8) == 8   # partial hellos closed at their deadline
        assert alive() and flood.replies["Error"] > FRAMES * 0.9
        assert flood.replies["Registered"] and flood.replies["Granted"], flood.replies   # past the first checks

        # every Error the fuzz got is counted (plus the page channels' bad hellos, which get none)
        errors = sum(n for reason, n in flood.errors.items() if reason != p.Reason.ENGINE_GONE.value)
        delta = rejected_total(daemon) - rejected0
        assert errors <= delta <= errors + CHANNELS + 8, (errors, delta)

        wait_for(lambda: fd_count(pid) <= fds0 + 2, timeout=10, what="the daemon's descriptors back")
        grown = rss_bytes(pid) - rss0
        assert grown < 16 * MiB, f"the fuzz grew the daemon by {grown / MiB:.1f} MiB"

        # the legitimate engine: same books, same data, and it still grows, serves and shrinks
        assert _engine(daemon) == before
        assert legit.do("read")["values"] == [7, 7]
        assert legit.do("ensure", n=8)["ok"]                     # 2 more slabs, idle: returned after 3 s
        assert legit.do("write", value=9)["values"] == [9] * 4
        assert legit.do("read")["values"] == [9] * 4
        wait_for(lambda: len(legit.state()["slabs"]) == 2 and _engine(daemon)["slabs"] == 2, timeout=10,
                 what="the engine returning its 2 idle slabs")
        assert _engine(daemon)["returns"] >= 1
    finally:
        legit.close()


def _engine(daemon) -> dict:
    [mine] = [e for e in daemon.status()["engines"] if e["engine_id"] == LEGIT]
    return {k: v for k, v in mine.items() if k not in ("idle", "starved_seconds")}   # these follow the clock
