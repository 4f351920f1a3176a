"""The node's KV event stream, decoded with vLLM's own classes, rebuilds exactly
the set of cached blocks the engines hold; a subscriber that missed batches
catches up through replay; a flood of replay requests does not hold up the
daemon's loop (security review, finding 6)."""

import collections
import time

import pytest
import zmq

from kvelastic import protocol as p
from kvelastic.daemon import events
from kvelastic.kv_events import AllBlocksCleared, BlockStored
from kvelastic_tools.figures import percentile
from tests.daemon.engines import EngineProcess
from tests.daemon.hostile import RawEngine, StatusProbe, kv_event_batches, register_message
from tests.daemon_proc import wait_for


def vllm_kv_events():
    """vLLM's event classes (only the stream test decodes with them)."""
    return pytest.importorskip("vllm.distributed.kv_events")


class Subscriber:
    """What a cluster router does: SUB to the stream, replay on a gap."""

    def __init__(self, endpoint, replay_endpoint):
        import msgspec

        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.kv = kv_events = vllm_kv_events()
        self.decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        self.counts = collections.Counter()      # (topic, group, hash) -> blocks holding it
        self.next_seq = 0
        self.gaps = 0

    def apply(self, topic, seq, payload):
        if seq < self.next_seq:
            return                                   # already seen (replay overlap)
        assert seq == self.next_seq, (seq, self.next_seq)
        self.next_seq = seq + 1
        kv_events = self.kv
        for event in self.decoder.decode(payload).events:
            if isinstance(event, kv_events.BlockStored):
                for h in event.block_hashes:
                    self.counts[(topic, event.group_idx, h)] += 1
            elif isinstance(event, kv_events.BlockRemoved):
                for h in event.block_hashes:
                    self.counts[(topic, event.group_idx, h)] -= 1
            elif isinstance(event, kv_events.AllBlocksCleared):
                for k in [k for k in self.counts if k[0] == topic]:
                    del self.counts[k]

    def drain(self, timeout_ms=200):
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq:                  # a gap: ask for what we missed
                self.gaps += 1
                self.catch_up()
            self.apply(topic, seq, payload)

    def catch_up(self):
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            self.apply(topic, int.from_bytes(seq, "big"), payload)
        dealer.close(0)

    def held(self):
        return {(t.decode(), h.hex()) for (t, _g, h), n in self.counts.items() if n > 0}


def engine_keys(engine, topic):
    # journal keys are vLLM's: 32-byte hash + 4-byte group id
    return {(topic, k[:-8]) for k in engine.do("keys")["keys"]}


def test_stream_rebuilds_the_cached_blocks_and_replays_gaps(daemon_factory):
    daemon = daemon_factory(memory="16MiB")
    endpoint = f"ipc://{daemon.socket}.kv-events"
    sub = Subscriber(endpoint, endpoint + "-replay")
    a = EngineProcess(daemon.socket, "a", grace=60, vllm_keys=True, namespace="llama")
    b = EngineProcess(daemon.socket, "b", grace=60, vllm_keys=True, namespace="qwen")
    try:
        import time

        time.sleep(0.3)                              # the SUB connection settles
        assert a.do("ensure", n=24)["ok"]
        a.do("alloc", n=24)
        a.do("cache", prefix="a1")
        a.do("free")                                 # 24 cached blocks in a
        assert b.do("ensure", n=8)["ok"]
        b.do("alloc", n=8)
        b.do("cache", prefix="b1")                   # 8 live, cached-keyed blocks in b
        expected = engine_keys(a, "kv@a@llama") | engine_keys(b, "kv@b@qwen")
        assert len(expected) == 32
        wait_for(lambda: sub.drain() or sub.held() == expected, what="the live stream")

        # the subscriber stops reading; meanwhile b needs memory and a's cache is reclaimed
        sub.sub.close(0)
        b.do("free")
        assert b.do("ensure", n=24)["ok"]            # 6 slabs: 4 of them reclaimed from a
        b.do("alloc", n=12)
        b.do("cache", prefix="b2")
        wait_for(lambda: len(engine_keys(a, "kv@a@llama")) < 24, what="a's cache reclaimed")
        late = Subscriber(endpoint, endpoint + "-replay")    # from sequence 0: the whole history
        expected = engine_keys(a, "kv@a@llama") | engine_keys(b, "kv@b@qwen")
        wait_for(lambda: late.catch_up() or late.held() == expected, what="the replayed stream")

        # a leaves: its blocks leave the stream too
        a.close()
        wait_for(lambda: not any(e["engine_id"] == "a" for e in daemon.status()["engines"]), what="a gone")
        expected = engine_keys(b, "kv@b@qwen")
        wait_for(lambda: late.catch_up() or late.held() == expected, what="a's blocks gone from the stream")
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------ replay flood
HISTORY = 3000          # batches kept when the flood comes (the default buffer keeps 10,000)
FLOOD = 200             # replay requests, each from a DEALER of its own, all of the whole history
STATUS_P90 = 0.5        # seconds; before the fix the flood held Status up for 8 s (25 s with 10,000 batches).
                        # p90, not p99: on a loaded 2-core machine one sample in 70 can lose the CPU for 0.5 s
STATUS_MAX = 2.0        # no single Status held up for longer, either
FLOOD_DEADLINE = 60.0   # every requester has its end marker by then (about 2 s here)


def history_key(i: int) -> bytes:
    return f"key-{i}".encode().ljust(36, b"x")


def fill_history(engine: RawEngine, batches: int) -> None:
    """``batches`` journals of one stored key each: one KV event batch each."""
    for i in range(batches):
        engine.send(p.Journal(engine_id=engine.engine_id, ops=[p.StoreKey(key=history_key(i), block=i % 4)],
                              occupancy={}))
    reply = engine.request(p.Journal(engine_id=engine.engine_id, ops=[], occupancy={}, sync=True), timeout=30)
    assert isinstance(reply, p.Ok), reply


def flood_replays(replay_endpoint: str, count: int, deadline: float) -> tuple[list[list[int]], int]:
    """``count`` DEALERs each ask for the whole history at once and read what
    comes back until their end marker or ``deadline``: the sequence numbers
    each one got, and how many got no end marker."""
    ctx = zmq.Context.instance()
    socks = []
    for _ in range(count):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(replay_endpoint)
        socks.append(s)
    got: dict[zmq.Socket, list[int]] = {s: [] for s in socks}
    poller = zmq.Poller()
    try:
        for s in socks:
            s.send_multipart([b"", (0).to_bytes(8, "big")])
            poller.register(s, zmq.POLLIN)
        waiting = set(socks)
        while waiting and time.monotonic() < deadline:
            for s, _ in poller.poll(200):
                while True:
                    try:
                        _, topic, seq, _payload = s.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if int.from_bytes(seq, "big", signed=True) == -1:
                        assert topic == b"" and s in waiting, "a second end marker"
                        waiting.discard(s)
                        poller.unregister(s)
                        break
                    got[s].append(int.from_bytes(seq, "big"))
        return [got[s] for s in socks], len(waiting)
    finally:
        for s in socks:
            s.close(0)


def test_a_replay_flood_does_not_hold_up_the_loop(daemon_factory):
    """Fault: with 3,000 batches of history kept, 200 requesters ask for all of
    it at once. Expected: the loop serves replays a bounded share at a time, so
    Status is answered promptly throughout (p90 under 0.5 s, none over 2 s);
    every requester gets an answer that ends with the end marker, either the
    whole history in order or, beyond the replays served at once, the end
    marker alone; and a normal replay afterwards returns every batch, in order."""
    daemon = daemon_factory()
    engine = RawEngine(daemon.socket, "history")
    probe = None
    try:
        assert isinstance(engine.request(register_message("history")), p.Registered)
        assert isinstance(engine.request(p.Grow(engine_id="history", slabs=1, demand=True)), p.Granted)
        fill_history(engine, HISTORY)
        probe = StatusProbe(daemon.socket, timeout=STATUS_MAX, interval=0.02)
        wait_for(lambda: len(probe.latencies) >= 3, what="the Status probe under way")
        answers, unanswered = flood_replays(f"ipc://{daemon.socket}.kv-events-replay", FLOOD,
                                            deadline=time.monotonic() + FLOOD_DEADLINE)
        wait_for(lambda: len(probe.latencies) >= 20, timeout=10, what="20 Status samples")
        latencies = probe.stop()
        probe = None
        p90, p99, worst = percentile(latencies, 0.9), percentile(latencies, 0.99), max(latencies)
        print(f"Status under a flood of {FLOOD} replays of {HISTORY} batches: p90 {p90 * 1000:.1f} ms, "
              f"p99 {p99 * 1000:.1f} ms, "
              f"max {worst * 1000:.1f} ms ({len(latencies)} samples)")
        assert p90 < STATUS_P90 and worst < STATUS_MAX, \
            f"Status p90 {p90:.3f} s, max {worst:.3f} s (inf: none within {STATUS_MAX} s) during the replay flood " \
            f"({len(latencies)} samples)"
        assert not unanswered, f"{unanswered} of {FLOOD} replay requests got no end marker"
        whole = [a for a in answers if a]
        assert whole, "no requester of the flood got its replay"
        for a in whole:   # (the engine may have journalled since: its idle return)
            assert len(a) >= HISTORY and a == list(range(len(a))), \
                f"a replay of {len(a)} batches, not the whole history in order"

        after = kv_event_batches(daemon.socket)
        assert [seq for _, seq, _ in after] == list(range(len(after))) and len(after) >= HISTORY
        for i, (topic, _, batch) in enumerate(after[:HISTORY]):
            (event,) = batch.events
            assert topic == b"kv@history@hostile" and isinstance(event, BlockStored), (i, topic, event)
            assert event.block_hashes == [history_key(i)], (i, event)
        assert daemon.proc.poll() is None
    finally:
        if probe is not None:
            probe.stop()
        engine.close()


# ------------------------------------------- the replay server, in process
@pytest.fixture
def publisher(tmp_path):
    """A KVEventPublisher on ipc endpoints with a clock the test moves, its
    replay sockets (DEALERs), and the batches it published."""
    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    ctx = zmq.Context.instance()
    clock = Clock()
    endpoint = f"ipc://{tmp_path}/ev"
    made: dict = {"clock": clock, "dealers": []}

    def make(buffer: int = 10_000, batches: int = 0) -> events.KVEventPublisher:
        pub = events.KVEventPublisher(ctx, endpoint, endpoint + "-replay", buffer, clock=clock)
        made["pub"] = pub
        publish(pub, batches)
        return pub

    def dealer(**opts) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        for opt, value in opts.items():
            s.setsockopt(getattr(zmq, opt), value)
        s.connect(endpoint + "-replay")
        made["dealers"].append(s)
        return s

    made.update(make=make, dealer=dealer)
    yield made
    for s in made["dealers"]:
        s.close(0)
    if "pub" in made:
        made["pub"].close()


def publish(pub, batches: int) -> None:
    for _ in range(batches):
        pub.publish(b"kv@e@ns", [AllBlocksCleared()])


def ask(sock: zmq.Socket, start: int = 0) -> None:
    sock.send_multipart([b"", start.to_bytes(8, "big")])


def asked(pub, count: int) -> None:
    """Read requests (they arrive asynchronously), sending nothing, until
    ``count`` have been read in all; then serve once."""
    wait_for(lambda: (pub.replay.poll(0) and pub._read_requests(pub._clock())) or pub.requests >= count,
             what=f"{count} replay requests read")
    pub.serve_replay()


def answer(sock: zmq.Socket, pub=None) -> list[int]:
    """What comes back to ``sock`` up to its end marker (serving the replays
    meanwhile when ``pub`` is given): the sequence numbers."""
    seqs: list[int] = []
    deadline = time.monotonic() + 10
    while True:
        if pub is not None:
            pub.serve_replay()
        if not sock.poll(0 if pub is not None and pub.has_work() else 50):
            assert time.monotonic() < deadline, f"no end marker after {seqs[-3:]}"
            if pub is not None and pub._replays and not pub.has_work():
                pub._clock.now += events.REPLAY_RETRY     # a full queue is tried again when due
            continue
        _, topic, seq, _payload = sock.recv_multipart()
        seq_no = int.from_bytes(seq, "big", signed=True)
        if seq_no == -1:
            assert topic == b""
            return seqs
        seqs.append(seq_no)


def test_replay_work_is_bounded_per_call_and_shared_round_robin(publisher):
    pub = publisher["make"](batches=300)
    a, b, c = (publisher["dealer"]() for _ in range(3))
    for s in (a, b, c):
        ask(s)
    asked(pub, 3)
    sent = {k: r.next_seq for k, r in pub._replays.items()}
    assert sum(sent.values()) == events.REPLAY_BATCHES_PER_CALL and max(sent.values()) - min(sent.values()) <= 1
    assert pub.has_work()
    assert answer(a, pub) == answer(b, pub) == answer(c, pub) == list(range(300))
    assert not pub.has_work() and not pub._replays


def test_a_replay_covers_what_was_published_when_asked_and_skips_what_was_evicted(publisher):
    pub = publisher["make"](buffer=100, batches=100)
    s = publisher["dealer"]()
    ask(s)
    asked(pub, 1)                                     # 0..63 sent
    publish(pub, 80)                                  # 0..79 evicted: 80..179 kept
    assert answer(s, pub) == [*range(64), *range(80, 100)]    # not 100..179: published after the request
    ask(s, 150)
    assert answer(s, pub) == list(range(150, 180))
    ask(s, 500)
    assert answer(s, pub) == []                       # nothing from there on: the end marker alone


def test_a_new_request_replaces_the_requesters_replay_in_progress(publisher):
    pub = publisher["make"](batches=300)
    s = publisher["dealer"]()
    ask(s)
    asked(pub, 1)                                     # 0..63 sent
    ask(s, 250)
    asked(pub, 2)                                     # replaced: 250..299 sent, then the end marker
    assert not pub._replays
    assert answer(s) == [*range(64), *range(250, 300)]   # one end marker: the first replay is gone


def test_requesters_beyond_the_cap_get_the_end_marker_alone(publisher, monkeypatch):
    monkeypatch.setattr(events, "MAX_REPLAYS", 2)
    pub = publisher["make"](batches=200)
    served = [publisher["dealer"]() for _ in range(2)]
    for s in served:
        ask(s)
    asked(pub, 2)
    late = publisher["dealer"]()
    ask(late)
    asked(pub, 3)
    assert pub.refused == 1 and answer(late) == []
    assert [answer(s, pub) for s in served] == [list(range(200))] * 2
    ask(late)                                         # room again
    assert answer(late, pub) == list(range(200))


def test_a_requester_asking_too_often_is_rate_limited(publisher, caplog):
    pub = publisher["make"](batches=10)
    clock = publisher["clock"]
    s = publisher["dealer"]()
    burst = int(events.REPLAY_RATE)
    for _ in range(burst + 5):
        ask(s)
    with caplog.at_level("WARNING", logger="kvelastic.daemon"):
        asked(pub, burst + 5)                         # one replay (each request replaced the one before)
        assert pub.rate_limited == 5
        assert len([r for r in caplog.records if "asks more than" in r.getMessage()]) == 1   # once a minute
    assert answer(s, pub) == list(range(10))
    clock.now += 1.0                                  # a second later: allowed again
    ask(s)
    assert answer(s, pub) == list(range(10)) and pub.rate_limited == 5
    other = publisher["dealer"]()                     # another requester is not limited by it
    ask(other)
    assert answer(other, pub) == list(range(10))


def test_a_requester_that_does_not_read_holds_up_neither_the_others_nor_the_loop(publisher):
    pub = publisher["make"](batches=5000)
    clock = publisher["clock"]
    stuck = publisher["dealer"](RCVHWM=1)             # never reads: its queue fills up
    ask(stuck)
    asked(pub, 1)
    # it is served until its queue is full, then skipped: no busy loop for it
    wait_for(lambda: pub.serve_replay() or not pub.has_work(), what="the stuck requester's queue full")
    reader = publisher["dealer"]()
    ask(reader)
    assert answer(reader, pub) == list(range(5000))
    assert len(pub._replays) == 1 and not pub.has_work()
    clock.now += events.REPLAY_RETRY                  # tried again when due, and still full
    assert pub.has_work()
    pub.serve_replay()
    assert not pub.has_work() and pub.abandoned == 0
    clock.now += events.REPLAY_STALL_TIMEOUT          # read nothing for that long: its replay dropped
    pub.serve_replay()
    assert pub.abandoned == 1 and not pub._replays and not pub.has_work()


def test_a_requester_that_goes_away_loses_its_replay(publisher):
    pub = publisher["make"](batches=5000)
    s = publisher["dealer"]()
    ask(s)
    asked(pub, 1)
    s.close(0)
    wait_for(lambda: pub.serve_replay() or not pub._replays, what="the replay of a closed DEALER dropped")
