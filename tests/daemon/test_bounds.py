"""One engine cannot grow the daemon without limit (finding 4).

A registered engine sends about 1 MiB messages that each tried to make the
daemon keep more: new cache keys for the same few blocks, occupancy of slabs
it does not hold, demotions of blocks over and over or of a slab it does not
hold, arbitrary counters, a huge namespace. Each is refused whole
or kept within what the engine holds, and the daemon's memory stays flat.
"""

import msgspec

from kvelastic import protocol as p
from kvelastic.kv_events import BlockRemoved
from tests.daemon.hostile import RawEngine, register_message


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def hostile_round(e: RawEngine, r: int) -> None:
    keys = [p.StoreKey(key=f"{r}-{i}".encode().ljust(200, b"x"), block=i % 4) for i in range(4000)]
    e.send(p.Journal(engine_id="greedy", ops=keys, occupancy={}))    # valid: re-keys its 4 blocks (no reply)
    reply = e.request(p.Journal(engine_id="greedy", ops=[], occupancy=dict.fromkeys(range(1, 50_000), (0, 0, 4))))
    assert isinstance(reply, p.Error) and reply.reason == "bad_journal"          # slabs it does not hold
    demotions = [p.DemoteBlock(block=i % 4) if i % 2 else p.PromoteBlock(block=i % 4) for i in range(20_000)]
    e.send(p.Journal(engine_id="greedy", ops=demotions[:19_999], occupancy={}))   # valid: its 4 blocks, no more
    reply = e.request(p.Journal(engine_id="greedy", ops=[p.DemoteBlock(block=4 * 1000)], occupancy={}))
    assert isinstance(reply, p.Error) and reply.reason == "bad_journal"          # a block of a slab not held
    e.sock.send(msgspec.msgpack.encode({"type": "Journal", "req_id": 9, "engine_id": "greedy", "ops": [],
                                        "occupancy": {}, "stats": {f"k{i}": i for i in range(30_000)}}))
    assert e.recv(5.0).reason == "malformed"                                      # more counters than allowed
    e.sock.send(p.encode(register_message("x" * 10, namespace="n" * 400_000)))
    assert e.recv(5.0).reason == "malformed"                                      # a name over 128 characters


def test_hostile_messages_do_not_grow_the_daemon(daemon_factory):
    # KV events off: their replay history is bounded on its own (test below).
    daemon = daemon_factory(KVELASTIC_KV_EVENTS_ENDPOINT="off")
    e = RawEngine(daemon.socket, "greedy")
    try:
        assert isinstance(e.request(register_message("greedy")), p.Registered)
        granted = e.request(p.Grow(engine_id="greedy", slabs=1, demand=True))
        assert isinstance(granted, p.Granted) and granted.slabs == [0]    # blocks 0..3
        for r in range(3):                                                # the allocator's high-water mark
            hostile_round(e, r)
        before = rss_bytes(daemon.proc.pid)
        for r in range(3, 23):
            hostile_round(e, r)
        grown = rss_bytes(daemon.proc.pid) - before
        status = e.request(p.Status()).status
        [mine] = status.engines
        assert mine.slabs == 1 and mine.cached_blocks == 0
        assert grown < 4 << 20, f"20 rounds of about 1 MiB hostile messages grew the daemon by {grown >> 20} MiB"
    finally:
        e.close()


def test_the_kv_event_replay_history_is_bounded_in_bytes():
    import zmq

    from kvelastic.daemon.events import MAX_REPLAY_BYTES, KVEventPublisher

    ctx = zmq.Context.instance()
    pub = KVEventPublisher(ctx, "inproc://bounds-pub", "inproc://bounds-replay", buffer=10_000)
    try:
        batch = [BlockRemoved(block_hashes=[bytes(32)] * 20_000, medium="CPU")]   # about 700 kB each
        for _ in range(60):
            pub.publish(b"kv@greedy@ns", batch)
        kept = sum(len(payload) for _, _, payload in pub._buffer)
        assert MAX_REPLAY_BYTES - 1_000_000 < kept <= MAX_REPLAY_BYTES and pub._buffered_bytes == kept
    finally:
        pub.close()
