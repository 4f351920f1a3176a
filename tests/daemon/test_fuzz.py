"""The structure-aware fuzzer (``kvelastic_tools.fuzz``) against a real daemon
no frame or page-channel connection crashes it, hangs it, or grows
it, every refusal is counted, and a legitimate engine beside the fuzz keeps
its slabs, its data and its status, and still grows, serves and shrinks.

Its sequence mode: well-formed protocol sequences from several
clients, engine ids reused while their last engines still depart, and
hostile-but-valid values lose no page, crash and hang nothing, and leave
the legitimate engine as it was."""

import collections
import itertools
import os

import msgspec
import pytest

from kvelastic import protocol as p
from kvelastic.daemon.server import _UNDECODABLE
from kvelastic.status_report import DeviceStatus, MemoryStatus, PageCounts, StatusReport
from kvelastic_tools import fuzz
from kvelastic_tools.bench import fuzzdrive as fd
from kvelastic_tools.bench.daemon import fd_count, rss_bytes
from kvelastic_tools.fuzzvalues import ValueBuilder
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

        # A seed whose frames get past registration (asserted below): the frames
        # follow the protocol's types, so a new field (of any message) moves the stream.
        fuzzer = fuzz.Fuzzer(2033, (LEGIT, NAMESPACE), hints=fuzz.daemon_hints(PAGE, os.getpid()))
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
        assert flood.replies["Registered"], flood.replies   # past the first checks

        # every Error the fuzz got is counted (plus the page channels' bad hellos, which get none)
        errors = sum(n for reason, n in flood.errors.items() if reason != p.Reason.ENGINE_GONE.value)
        delta = rejected_total(daemon) - rejected0
        assert errors <= delta <= errors + CHANNELS + 8, (errors, delta)

        wait_for(lambda: fd_count(pid) <= fds0 + 2, timeout=10, what="the daemon's descriptors back")
        grown = rss_bytes(pid) - rss0
        assert grown < 16 * MiB, f"the fuzz grew the daemon by {grown / MiB:.1f} MiB"

        # The fuzzer's registrations reach a grant. Not left to the flood: there a
        # grow must meet its engine's registration on the same socket within the
        # heartbeat timeout, which a loaded machine decides (1 grant in 20,000
        # frames when idle, none under load): here each is sent right after.
        assert _grants_reached(daemon.socket, fuzzer)["Granted"]

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


def _grants_reached(socket_path: str, fuzzer: fuzz.Fuzzer, tries: int = 40) -> collections.Counter:
    """Replies to ``tries`` of the fuzzer's registrations, each that is
    accepted followed at once by a grow of one slab on the same socket."""
    replies: collections.Counter = collections.Counter()
    sock = fd.dealer(socket_path)
    try:
        def call(msg: bytes) -> p.Msg:
            sock.send(msg)
            assert sock.poll(int(fd.PROBE_TIMEOUT * 1000)), "the daemon did not answer"
            reply = p.decode(sock.recv())
            replies[type(reply).__name__] += 1
            return reply

        for _ in range(tries):
            reg = p.decode(fuzzer.valid(p.RegisterEngine))
            if isinstance(call(p.encode(reg)), p.Registered):
                call(p.encode(p.Grow(req_id=1, engine_id=reg.engine_id, slabs=1, demand=True)))
    finally:
        sock.close(0)
    return replies


def _engine(daemon) -> dict:
    [mine] = [e for e in daemon.status()["engines"] if e["engine_id"] == LEGIT]
    return {k: v for k, v in mine.items() if k not in ("idle", "starved_seconds")}   # these follow the clock


# ------------------------------------------------------------ sequence mode
BUDGET = 64 * MiB


def test_sequence_plans_are_seeded_reuse_ids_and_reach_every_step():
    from kvelastic_tools.bench import fuzzseq

    seq = fuzz.Sequences(5, PAGE, BUDGET, victims=(LEGIT,))
    plans = list(itertools.islice(seq.sessions(0), 400))
    # a seed replays the same plans, client by client; another client plans otherwise
    assert plans == list(itertools.islice(fuzz.Sequences(5, PAGE, BUDGET, victims=(LEGIT,)).sessions(0), 400))
    assert plans[:20] != list(itertools.islice(seq.sessions(1), 20))
    # few ids, often the last one again at once (while its engine may still be departing)
    assert {s.engine_id for s in plans} <= set(seq.ids) | {LEGIT}
    again = sum(a.engine_id == b.engine_id for a, b in zip(plans, plans[1:]))
    assert again > len(plans) * 0.5, again
    assert {name for s in plans for name, _ in s.actions} == set(fuzz.ACTIONS)
    assert {s.ending for s in plans} == set(fuzz.ENDINGS)
    assert {s.reclaims for s in plans} == set(fuzz.RECLAIM_ANSWERS)
    workers = [w for s in plans for w in s.workers]
    assert {w.maps for w in workers} == set(fuzz.ACKS) and {w.unmaps for w in workers} == set(fuzz.UNMAP_ACKS)
    assert {w.channel for w in workers} == {"right", "wrong_token", "no_token", "none", "after"}
    assert any(w.process for w in workers) and any(w.hello_rank < -1 for w in workers)
    assert {len(s.token) >= p.MIN_TOKEN for s in plans} == {True, False}
    # hostile but valid: extreme values in registrations that still decode as what they are
    extreme = fuzz.hostile_ints(PAGE, BUDGET)
    hostile = collections.Counter(name for s in plans for name in s.hostile)
    assert set(hostile) >= {"blocks_per_slab", "block_bytes", "pages_per_worker", "num_workers", "min_bytes",
                            "max_bytes"}, hostile
    assert any(s.fields["blocks_per_slab"] >= 2**40 for s in plans)
    for s in plans:
        fields = {k: v for k, v in s.fields.items() if k in p.RegisterEngine.__struct_fields__}
        msg = p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id=s.engine_id, namespace=s.namespace,
                               page_size=PAGE, token=s.token, **fields)
        assert type(p.decode(p.encode(msg))) is p.RegisterEngine
    assert all(isinstance(v, int) for values in extreme.values() for v in values)
    assert fuzzseq.DAEMON_TIMING["KVELASTIC_ORPHAN_CACHE_TTL"] != "0"   # kept cache (and its walks) is reached


def test_books_count_a_page_that_has_no_place():
    def report(created, free, held, orphaned=0, adopted=0):
        memory = MemoryStatus(held=held * PAGE, cached=0, free=free * PAGE, unallocated=0, orphaned=orphaned * PAGE)
        pages = PageCounts(created=created, free=free, adopted=adopted)
        device = DeviceStatus(device="0", backend="host", budget_bytes=BUDGET, memory=memory, pages=pages)
        return StatusReport(device="0", backend="host", page_size=PAGE, budget_bytes=BUDGET, memory=memory,
                              pages=pages, devices=[device], engines=[])

    assert fd.books(report(10, 4, 4, 2))["unbooked"] == 0
    assert fd.books(report(10, 4, 4, 0))["unbooked"] == 2            # two pages in no record: lost
    assert fd.books(report(10, 4, 7, 0, adopted=3))["unbooked"] == 2  # adopted pages are held, not created


@pytest.mark.slow
def test_hostile_sequences_lose_no_page_and_hang_nothing():
    """Several clients, five engine ids reused while their last engines still
    depart, extreme values, late and missing acks, impostors, kill -9: the
    daemon neither crashes nor hangs, every page keeps a place all along, none
    is held once everyone left, and the legitimate engine is untouched."""
    from kvelastic_tools.bench import fuzzseq

    out = fuzzseq.run(quick=True, seed=2024)
    counts = out["counts"]
    where = {k: out.get(k) for k in ("first_unbooked", "trace_before_the_freeze", "log_before_the_freeze",
                                     "trace_before_the_first_hang", "first_traceback")}
    assert out["crashes"] == 0 and out["hangs"] == 0, where
    assert out["unbooked_pages_max"] == 0 and out["pages_lost"] == 0, (out.get("end"), where)
    assert out["handles_not_in_books"] == 0 and out["daemon_log_tracebacks"] == 0, where
    assert not counts.get("problems"), counts.get("problems")        # no internal error, no fuzzer bug
    assert out["legitimate_engine"]["ok"], out["legitimate_engine"]
    assert out["end"]["engines"] == [LEGIT] and out["end"]["held"] == out["end"]["legit_pages"]
    # it went where it should: ids reused while departing, extreme engines admitted, every way out taken
    registrations = counts["registrations"]
    assert registrations.get("reused_while_departing", 0) > 0 and registrations.get("accepted:extreme", 0) > 0
    assert len(counts["endings"]) >= 5 and counts["acks"] and counts["sent"]["Journal"], counts
    assert 0 < out["status_p99_ms"] < fd.PROBE_TIMEOUT * 1e3 and out["probes"] > 100
