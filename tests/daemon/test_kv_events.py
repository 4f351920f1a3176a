"""The node's KV event stream, decoded with vLLM's own classes, rebuilds exactly
the set of cached blocks the engines hold; a subscriber that missed batches
catches up through replay."""

import collections

import pytest
import zmq

from tests.daemon.engines import EngineProcess
from tests.daemon_proc import wait_for

kv_events = pytest.importorskip("vllm.distributed.kv_events")


class Subscriber:
    """What a cluster router does: SUB to the stream, replay on a gap."""

    def __init__(self, endpoint, replay_endpoint):
        import msgspec

        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        self.counts = collections.Counter()      # (topic, group, hash) -> blocks holding it
        self.next_seq = 0
        self.gaps = 0

    def apply(self, topic, seq, payload):
        if seq < self.next_seq:
            return                                   # already seen (replay overlap)
        assert seq == self.next_seq, (seq, self.next_seq)
        self.next_seq = seq + 1
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
