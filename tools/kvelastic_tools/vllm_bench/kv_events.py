"""KV event streams, as the tests read them: vLLM's own publisher and the
kvelastic daemon's node stream, both ``(topic, seq, msgpack KVEventBatch)``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgspec
import zmq


def ext_hash(h: int | bytes) -> int:
    """A block hash as vLLM publishes it by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1,
    ``maybe_convert_block_hash``): the low 64 bits of the hash bytes, unsigned."""
    return h & ((1 << 64) - 1) if isinstance(h, int) else int.from_bytes(h, "big") & ((1 << 64) - 1)


def _field(ev, name: str, pos: int):
    return ev.get(name) if isinstance(ev, dict) else (ev[pos] if len(ev) > pos else None)


class CacheModel:
    """The cached blocks a stream describes: hash -> token ids (None if the event had none).
    ``chain`` remembers every block ever stored by (parent hash, token ids), so
    that a prompt's blocks can be named by hash (``held_prefix``); ``parents``
    each such block's parent (None: a chain's first block)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, ...] | None] = {}
        self.chain: dict[tuple[int | None, tuple[int, ...]], int] = {}
        self.parents: dict[int, int | None] = {}
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.batches = 0

    def apply(self, payload: bytes) -> None:
        ts, events, *_ = msgspec.msgpack.decode(payload)
        self.batches += 1
        for ev in events:
            kind = str(ev.get("type") if isinstance(ev, dict) else ev[0])
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if kind == "BlockStored":
                hashes = _field(ev, "block_hashes", 1)
                parent = _field(ev, "parent_block_hash", 2)
                parent = None if parent is None else ext_hash(parent)
                tokens = _field(ev, "token_ids", 3) or []
                size = _field(ev, "block_size", 4)
                for i, h in enumerate(hashes):
                    chunk = tuple(tokens[i * size:(i + 1) * size])
                    self.blocks[ext_hash(h)] = chunk if len(chunk) == size else None
                    if len(chunk) == size:
                        self.chain[(parent, chunk)] = ext_hash(h)
                    self.parents[ext_hash(h)] = parent
                    parent = ext_hash(h)
            elif kind == "BlockRemoved":
                for h in _field(ev, "block_hashes", 1):
                    self.blocks.pop(ext_hash(h), None)
            elif kind == "AllBlocksCleared":
                self.blocks.clear()

    def hashes(self) -> set[int]:
        return set(self.blocks)

    def reachable(self, held: set[int]) -> set[int]:
        """The blocks of ``held`` whose every ancestor is in ``held`` too: those
        vLLM's prefix lookup can hit (parents as this stream has seen them)."""
        out: set[int] = set()
        for h in held:
            x: int | None = h
            while x is not None and x in held and x in self.parents:
                x = self.parents[x]
            if x is None:
                out.add(h)
        return out

    def held_prefix(self, tokens: list[int], block_size: int, held: set[int]) -> int:
        """How many tokens of a prompt's leading whole blocks are in ``held``
        (hashes), at most what vLLM can hit: the last token is always computed."""
        parent: int | None = None
        n = 0
        for i in range((len(tokens) - 1) // block_size):
            h = self.chain.get((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
            if h is None or h not in held:
                break
            parent, n = h, n + 1
        return n * block_size


class Subscriber:
    """A SUB socket read by a thread of its own into a ``CacheModel``. With
    ``replay_endpoint``, it first asks for every batch published before it
    connected (as a router that joins late does), then skips live batches it
    already has."""

    def __init__(self, endpoint: str, topic: bytes = b"", replay_endpoint: str | None = None) -> None:
        self.model = CacheModel()
        self.lock = threading.Lock()
        self.topic = topic
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self.last_seq = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._replay_endpoint:
            for seq, topic, payload in replay(self._replay_endpoint, 0, with_topics=True):
                if topic.startswith(self.topic):
                    with self.lock:
                        self.last_seq = seq
                        self.model.apply(payload)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(50):
                topic, seq, payload = self._sock.recv_multipart()
                number = int.from_bytes(seq, "big")
                with self.lock:
                    if number <= self.last_seq:   # replayed already
                        continue
                    self.last_seq = number
                    self.model.apply(payload)

    def hashes(self) -> set[int]:
        with self.lock:
            return self.model.hashes()

    def held_prefix(self, tokens: list[int], block_size: int, held: set[int]) -> int:
        with self.lock:
            return self.model.held_prefix(tokens, block_size, held)

    def snapshot(self) -> CacheModel:
        with self.lock:
            m = CacheModel()
            m.blocks = dict(self.model.blocks)
            m.chain = dict(self.model.chain)
            m.parents = dict(self.model.parents)
            m.counts = dict(self.model.counts)
            m.batches = self.model.batches
            return m

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()


def dump_hashes(dump: dict, model_name: str, worker_id: int) -> set[int]:
    """The block hashes Dynamo's ``/dump`` holds for one worker."""
    out: set[int] = set()
    for ev in dump.get(f"{model_name}:default", {}).get("events", []):
        if ev["worker_id"] != worker_id:
            continue
        data = ev["event"]["data"]
        if "stored" in data:
            out.update(b["block_hash"] for b in data["stored"]["blocks"])
    return out


def wait_for(cond: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def replay(endpoint: str, start: int, timeout: float = 10.0, with_topics: bool = False) -> list:
    """Ask a publisher's replay socket for every batch from ``start`` on, as
    a router does after a gap: (seq, payload), or (seq, topic, payload),
    until the empty end marker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list = []
        while True:
            frames = sock.recv_multipart()
            topic, seq, payload = frames[-3], frames[-2], frames[-1]
            if not payload:
                return out
            number = int.from_bytes(seq, "big")
            out.append((number, topic, payload) if with_topics else (number, payload))
    finally:
        sock.close(0)
        ctx.term()
