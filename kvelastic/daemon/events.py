"""The node's KV event stream, in vLLM's format, for cluster routers.

Every engine's journal becomes ``KVEventBatch`` messages on one ZMQ PUB
socket: ``(topic, sequence number, payload)`` with the topic
``kv@ENGINE@NAMESPACE`` (llm-d's convention), so a router subscribes once per
node. The last ``buffer`` batches are kept; a subscriber that missed some asks
the ROUTER replay socket for everything from a sequence number on, exactly as
with vLLM's ``ZmqEventPublisher`` (the same frames).

Replays run on the daemon's loop, so each call does bounded work: a replay is a
cursor over the kept batches, up to what was published when it was asked for;
each ``serve_replay()`` sends at most ``REPLAY_BATCHES_PER_CALL`` batches in all,
one requester after another (round robin), and the loop comes back while
``has_work()``. A requester (ZMQ identity) has one replay at a time (asking
again replaces it), at most ``MAX_REPLAYS`` requesters are served at once (the
next one gets the end marker alone), each may ask ``REPLAY_RATE`` times a
second (extra requests are dropped), and one that does not read its answers is
skipped until its queue has room, and dropped after ``REPLAY_STALL_TIMEOUT``.

The tier stream (``TierStream``) is a publisher of its own whose events carry
every tenant's token ids: off TCP unless its sockets speak CURVE
(``curve.py``) or its events are stripped of them (``without_token_ids``).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.config import Config
from kvelastic.daemon.curve import CurveGuard, CurveServer, load_server
from kvelastic.errors import ConfigError
from kvelastic.kv_events import (
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    tier_topic,
)

log = logging.getLogger("kvelastic.daemon")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


MAX_REPLAY_BYTES = 16 << 20   # replay history kept, whatever the batch count allows
REPLAY_BATCHES_PER_CALL = 64  # batches one serve_replay() sends, every requester together
REPLAY_BYTES_PER_CALL = 4 << 20   # and their bytes (at least one batch is sent)
REPLAY_REQUESTS_PER_CALL = 64     # requests one serve_replay() reads
MAX_REPLAYS = 64              # requesters with a replay in progress
REPLAY_RATE = 10.0            # replay requests a second per requester (a burst of as many)
REPLAY_RETRY = 0.01           # a requester whose queue is full is tried again after this
REPLAY_STALL_TIMEOUT = 30.0   # ... and loses its replay when it has read nothing for this long
MAX_REQUESTERS = 4096         # requesters whose request rate is remembered (the least recent go)
LOG_EVERY = 60.0              # a repeated refusal is logged at most this often


@dataclass
class _Replay:
    next_seq: int             # the next batch to send (or the oldest kept, if that is later)
    end_seq: int              # what had been published when it was asked for (exclusive)
    progressed_at: float      # when it last sent something
    retry_at: float = 0.0     # its queue was full: not tried again before this


@dataclass
class _Requester:
    tokens: float             # requests it may still make now
    updated: float
    warned_at: float = float("-inf")


class KVEventPublisher:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, replay_endpoint: str, buffer: int,
                 clock: Callable[[], float] = time.monotonic, uids: Sequence[int] = (),
                 curve: CurveServer | None = None, token_ids: bool = True) -> None:
        """``uids``: on ``ipc://``, only peers of these users may connect (none: anyone who can open the socket);
        ``curve``: both sockets are CURVE servers taking only its clients' keys; ``token_ids``: False strips
        stored blocks to their hashes (``without_token_ids``), in what is sent and what is kept for replay."""
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.guard = CurveGuard(ctx, curve) if curve is not None else None
        self.token_ids = token_ids
        for sock in (self.pub, self.replay):
            for uid in uids:
                sock.setsockopt(zmq.IPC_FILTER_UID, uid)
            if self.guard is not None:      # before bind: no connection is ever taken without CURVE
                self.guard.secure(sock)
        self.pub.bind(endpoint)
        # A full queue to a requester (or one that is gone) is an error we see,
        # not a batch silently dropped: its replay waits, or ends.
        self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.replay.bind(replay_endpoint)
        self.endpoints = (endpoint, replay_endpoint)
        self._buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque(maxlen=buffer)
        self._buffered_bytes = 0
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._clock = clock
        self._replays: dict[bytes, _Replay] = {}
        self._turns: collections.deque[bytes] = collections.deque()   # the same keys, in serving order
        self._requesters: collections.OrderedDict[bytes, _Requester] = collections.OrderedDict()
        self.requests = 0             # replay requests read (well-formed)
        self.malformed = 0            # and not
        self.refused = 0              # requests answered with the end marker alone (MAX_REPLAYS busy)
        self.rate_limited = 0         # requests dropped (a requester asking too often)
        self.abandoned = 0            # replays dropped because their requester stopped reading
        self._logged_at: dict[str, float] = {}

    def publish(self, topic: bytes, events: list[KVEvent]) -> None:
        if not events:
            return
        if not self.token_ids:
            events = [without_token_ids(e) for e in events]
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        seq = self._seq
        self._seq += 1
        if len(self._buffer) == self._buffer.maxlen:
            self._buffered_bytes -= len(self._buffer[0][2])
        self._buffer.append((seq, topic, payload))
        self._buffered_bytes += len(payload)
        while self._buffered_bytes > MAX_REPLAY_BYTES and len(self._buffer) > 1:   # bounded in bytes too
            self._buffered_bytes -= len(self._buffer.popleft()[2])
        try:
            self.pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            pass  # a slow subscriber catches up through replay

    def has_work(self) -> bool:
        """A replay in progress can send now: the loop should come back at once
        (a requester whose queue is full counts again once its retry is due)."""
        if not self._replays:
            return False
        now = self._clock()
        return any(r.retry_at <= now for r in self._replays.values())

    def serve_replay(self) -> None:
        """Read waiting replay requests, ``(b"", start_seq)``, and send the next
        few batches of the replays in progress: each requester gets every kept
        batch from ``start_seq`` on, up to the ones published when it asked,
        then the end marker ``(b"", b"", END_SEQ, b"")``. Bounded work per call."""
        now = self._clock()
        self._read_requests(now)
        self._send_batches(now)

    def _read_requests(self, now: float) -> None:
        for _ in range(REPLAY_REQUESTS_PER_CALL):
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                self.malformed += 1
                self._log_every("malformed", "kv events: malformed replay request (%d frames; %d so far)",
                                len(frames), self.malformed)
                continue
            client, _, start = frames
            self.requests += 1
            if not self._admit(client, now):
                continue
            if client not in self._replays:
                if len(self._replays) >= MAX_REPLAYS:
                    self.refused += 1
                    self._log_every("refused", "kv events: %d replays in progress, the most served at once: "
                                    "a new request gets the end marker alone (%d so far)", MAX_REPLAYS, self.refused)
                    self._send(client, (b"", b"", END_SEQ, b""))
                    continue
                self._turns.append(client)
            # a new request from the same requester replaces its replay in progress
            self._replays[client] = _Replay(int.from_bytes(start, "big"), self._seq, now)

    def _admit(self, client: bytes, now: float) -> bool:
        """The requester's rate limit (a token bucket of ``REPLAY_RATE``)."""
        r = self._requesters.get(client)
        if r is None:
            r = self._requesters[client] = _Requester(REPLAY_RATE, now)
            if len(self._requesters) > MAX_REQUESTERS:
                self._requesters.popitem(last=False)
        else:
            self._requesters.move_to_end(client)
            r.tokens = min(REPLAY_RATE, r.tokens + (now - r.updated) * REPLAY_RATE)
            r.updated = now
        if r.tokens >= 1.0:
            r.tokens -= 1.0
            return True
        self.rate_limited += 1
        if now - r.warned_at >= LOG_EVERY:
            r.warned_at = now
            log.warning("kv events: replay requester %s asks more than %g times a second: extra requests "
                        "dropped (%d so far, all requesters)", client.hex(), REPLAY_RATE, self.rate_limited)
        return False

    def _send_batches(self, now: float) -> None:
        batches, nbytes = REPLAY_BATCHES_PER_CALL, 0
        waiting = 0                           # requesters in a row that could not be sent to
        while batches > 0 and nbytes < REPLAY_BYTES_PER_CALL and waiting < len(self._turns):
            client = self._turns.popleft()
            replay = self._replays[client]
            if replay.retry_at > now:
                self._turns.append(client)
                waiting += 1
                continue
            oldest = self._buffer[0][0] if self._buffer else self._seq
            seq = max(replay.next_seq, oldest)     # batches evicted meanwhile: from the oldest kept one
            if seq < replay.end_seq:
                _, topic, payload = self._buffer[seq - oldest]
                frames: tuple[bytes, ...] = (b"", topic, seq.to_bytes(8, "big"), payload)
            else:
                frames = (b"", b"", END_SEQ, b"")
            sent = self._send(client, frames)
            if sent is None:                       # its queue is full: the others go first
                if now - replay.progressed_at >= REPLAY_STALL_TIMEOUT:
                    self.abandoned += 1
                    self._log_every("abandoned", "kv events: a replay requester read nothing for %g s: "
                                    "its replay dropped (%d so far)", REPLAY_STALL_TIMEOUT, self.abandoned)
                    del self._replays[client]
                    continue
                replay.retry_at = now + REPLAY_RETRY
                self._turns.append(client)
                waiting += 1
                continue
            waiting = 0
            if not sent or seq >= replay.end_seq:  # gone, or done
                del self._replays[client]
                continue
            batches -= 1
            nbytes += len(frames[3])
            replay.next_seq, replay.progressed_at = seq + 1, now
            self._turns.append(client)

    def _send(self, client: bytes, frames: tuple[bytes, ...]) -> bool | None:
        """True: sent; None: the requester's queue is full; False: it is gone."""
        try:
            self.replay.send_multipart((client, *frames), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return None
        except zmq.ZMQError:                       # EHOSTUNREACH: disconnected
            return False

    def _log_every(self, what: str, message: str, *args: object) -> None:
        now = self._clock()
        if now - self._logged_at.get(what, float("-inf")) >= LOG_EVERY:
            self._logged_at[what] = now
            log.warning(message, *args)

    def ipc_paths(self) -> list[str]:
        return [e[len("ipc://"):] for e in self.endpoints if e.startswith("ipc://")]

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)
        if self.guard is not None:
            self.guard.stop()
        for path in self.ipc_paths():  # ZMQ leaves ipc socket files behind
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def journal_events(ops: Sequence[p.JournalOp], block_tokens: int, group_suffix: bool, medium: str) -> list[KVEvent]:
    """A journal's index changes as vLLM events (``key`` = hash + 4-byte group
    id for vLLM engines, an opaque hash otherwise)."""
    events: list[KVEvent] = []
    for op in ops:
        if isinstance(op, (p.StoreKey, p.RemoveKey)):
            key = op.key
            block_hash, group = (key[:-4], int.from_bytes(key[-4:], "big")) if group_suffix else (key, None)
            if isinstance(op, p.StoreKey):
                events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=[],
                                            block_size=block_tokens, lora_id=None, medium=medium,
                                            lora_name=None, group_idx=group))
            else:
                events.append(BlockRemoved(block_hashes=[block_hash], medium=medium, group_idx=group))
        elif isinstance(op, p.ClearKeys):
            events.append(AllBlocksCleared())
    return events


# ------------------------------------------------------------------ the tier
_label_decoder = msgspec.msgpack.Decoder(BlockStored)


def tier_stored(key: bytes, label: bytes) -> BlockStored | None:
    """The ``BlockStored`` announcing the tier's copy of the block keyed ``key``:
    its label (the engine's own one-block event: vLLM's hash, parent hash,
    token ids) with the medium ``STORAGE``. None without a label, or with one
    that does not decode or names another block (the key's hash, whole or
    less a vLLM engine's 4-byte group suffix, as vLLM publishes it: the bytes,
    or their low 64 bits)."""
    if not label:
        return None
    try:
        event = _label_decoder.decode(label)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if len(event.block_hashes) != 1 or not event.token_ids:
        return None
    published = event.block_hashes[0]
    names = (key, key[:-4]) if len(key) > 4 else (key,)
    if not any(published == h or published == int.from_bytes(h, "big") & ((1 << 64) - 1) for h in names):
        return None
    return msgspec.structs.replace(event, medium=MEDIUM_STORAGE)


def node_stored(key: bytes, event: BlockStored) -> BlockStored:
    """The node stream's account of a tier block: as the engines' blocks there
    (``journal_events``), its key (less a vLLM engine's group suffix), no
    parent and no token ids; those go on the tier stream alone."""
    group = event.group_idx
    return BlockStored(block_hashes=[key[:-4] if group is not None and len(key) > 4 else key],
                       parent_block_hash=None, token_ids=[], block_size=event.block_size, lora_id=None,
                       medium=MEDIUM_STORAGE, lora_name=None, group_idx=group)


def parents_first(events: list[BlockStored]) -> list[BlockStored]:
    """``events`` in an order where a block comes after its parent when both
    are among them (a router files a block under its parent, and drops one
    whose parent it does not hold)."""
    by_hash: dict[tuple[bytes | int | None, int | None], BlockStored] = \
        {(e.block_hashes[0], e.group_idx): e for e in events}
    out: list[BlockStored] = []
    placed: set[tuple[bytes | int | None, int | None]] = set()
    for event in events:
        chain = []
        block: tuple[bytes | int | None, int | None] = (event.block_hashes[0], event.group_idx)
        while block in by_hash and block not in placed:
            placed.add(block)
            chain.append(by_hash[block])
            parent = by_hash[block].parent_block_hash
            block = (parent, event.group_idx)
        out.extend(reversed(chain))
    return out


def without_token_ids(event: KVEvent) -> KVEvent:
    """A stored block as its hashes alone: hash, parent, block size, group,
    medium. Left out: what it holds (token ids) and whose it is (LoRA, extra
    keys: cache salt, multimodal hashes; session, locality, ownership)."""
    if not isinstance(event, BlockStored):
        return event
    return BlockStored(block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash, token_ids=[],
                       block_size=event.block_size, lora_id=None, medium=event.medium, lora_name=None,
                       group_idx=event.group_idx, kv_cache_spec_kind=event.kv_cache_spec_kind,
                       kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window)


@dataclass(frozen=True)
class TierStream:
    """Where and how the tier stream is published (``tier_stream``); ``endpoint`` empty: off, for ``off_reason``."""
    endpoint: str
    replay_endpoint: str
    buffer: int
    token_ids: bool = True
    curve: CurveServer | None = None
    off_reason: str = ""

    def open(self, ctx: zmq.Context[zmq.Socket[bytes]], uids: Sequence[int]) -> KVEventPublisher | None:
        """The stream's publisher, its life started with ``AllBlocksCleared``
        (none announced yet); None when it is off (said once, with why)."""
        if not self.endpoint:
            log.info("tier KV events off: %s", self.off_reason)
            return None
        stream = KVEventPublisher(ctx, self.endpoint, self.replay_endpoint, self.buffer, uids=uids,
                                  curve=self.curve, token_ids=self.token_ids)
        stream.publish(tier_topic(""), [AllBlocksCleared()])
        how = ([f"CURVE, {len(self.curve.clients)} client key(s)"] if self.curve else []) + \
            ([] if self.token_ids else ["without token ids"])
        log.info("tier KV events on %s (replay %s)%s", *stream.endpoints, f": {', '.join(how)}" if how else "")
        return stream


def tier_stream(config: Config) -> TierStream:
    """The tier stream the configuration asks for, checked at start: on an
    endpoint that is not ``ipc://`` (whose socket files only the daemon's user
    may connect to), its events, which carry every tenant's token ids, go
    only under CURVE or stripped of them; either way is the operator's choice."""
    curve = (load_server(config.tier_events_curve_cert, config.tier_events_curve_clients)
             if config.tier_events_curve_cert else None)
    if config.tier_events_curve_clients and curve is None:
        raise ConfigError("KVELASTIC_TIER_EVENTS_CURVE_CLIENTS needs KVELASTIC_TIER_EVENTS_CURVE_CERT, the "
                          "server's certificate: without it the tier stream does not speak CURVE")
    endpoints = (config.tier_events_endpoint, config.tier_events_replay_endpoint)
    exposed = [e for e in endpoints if e and not e.startswith("ipc://")]
    if exposed and curve is None and config.tier_events_token_ids:
        raise ConfigError(
            f"the tier stream's endpoint {exposed[0]!r} is not ipc:// and its events carry every tenant's "
            "token ids: anyone who reaches it would read them. Either set KVELASTIC_TIER_EVENTS_CURVE_CERT "
            "(the server's CURVE certificate) and KVELASTIC_TIER_EVENTS_CURVE_CLIENTS (the subscribers' public "
            "keys), or KVELASTIC_TIER_EVENTS_TOKEN_IDS=0 (hashes and parents only); docs/kv-events.md")
    return TierStream(*endpoints, config.kv_events_buffer, config.tier_events_token_ids, curve,
                      "" if config.tier_events_endpoint else _off_reason(config.kv_events_endpoint))


def _off_reason(node: str) -> str:
    """Why the tier stream is off, for the operator's log (``config.tier_endpoints``)."""
    if node.startswith("ipc://"):
        return "KVELASTIC_TIER_EVENTS_ENDPOINT=off"
    if not node:
        return "the node stream is off and KVELASTIC_TIER_EVENTS_ENDPOINT is unset"
    return (f"the node stream is on {node}, and the tier stream's events carry every tenant's token ids, so it "
            "does not follow it there; to publish it off ipc set KVELASTIC_TIER_EVENTS_ENDPOINT with CURVE "
            "(KVELASTIC_TIER_EVENTS_CURVE_CERT and KVELASTIC_TIER_EVENTS_CURVE_CLIENTS) or "
            "KVELASTIC_TIER_EVENTS_TOKEN_IDS=0 (docs/kv-events.md)")
