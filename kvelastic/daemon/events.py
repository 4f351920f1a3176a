"""The node's KV event stream, in vLLM's format, for cluster routers.

Every engine's journal becomes ``KVEventBatch`` messages on one ZMQ PUB
socket: ``(topic, sequence number, payload)`` with the topic
``kv@ENGINE@NAMESPACE`` (llm-d's convention), so a router subscribes once per
node. The last ``buffer`` batches are kept; a subscriber that missed some asks
the ROUTER replay socket for everything from a sequence number on, exactly as
with vLLM's ``ZmqEventPublisher``.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Sequence

import msgspec
import zmq

from kvelastic import protocol as p

log = logging.getLogger("kvelastic.daemon")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


MAX_REPLAY_BYTES = 16 << 20   # replay history kept, whatever the batch count allows


class KVEventPublisher:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, replay_endpoint: str, buffer: int) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(replay_endpoint)
        self.endpoints = (endpoint, replay_endpoint)
        self._buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque(maxlen=buffer)
        self._buffered_bytes = 0
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, topic: bytes, events: list[p.KVEvent]) -> None:
        if not events:
            return
        payload = self._encoder.encode(p.KVEventBatch(ts=time.time(), events=events))
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

    def serve_replay(self) -> None:
        """Answer waiting replay requests: ``(b"", start_seq)`` -> every kept
        batch from ``start_seq`` on, then an end marker."""
        while True:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, topic, payload in self._buffer:
                if seq >= start_seq:
                    self.replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def ipc_paths(self) -> list[str]:
        return [e[len("ipc://"):] for e in self.endpoints if e.startswith("ipc://")]

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)
        for path in self.ipc_paths():  # ZMQ leaves ipc socket files behind
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def journal_events(ops: Sequence[p.JournalOp], block_tokens: int, group_suffix: bool, medium: str) -> list[p.KVEvent]:
    """A journal's index changes as vLLM events (``key`` = hash + 4-byte group
    id for vLLM engines, an opaque hash otherwise)."""
    events: list[p.KVEvent] = []
    for op in ops:
        if isinstance(op, (p.StoreKey, p.RemoveKey)):
            key = op.key
            block_hash, group = (key[:-4], int.from_bytes(key[-4:], "big")) if group_suffix else (key, None)
            if isinstance(op, p.StoreKey):
                events.append(p.BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=[],
                                            block_size=block_tokens, lora_id=None, medium=medium,
                                            lora_name=None, group_idx=group))
            else:
                events.append(p.BlockRemoved(block_hashes=[block_hash], medium=medium, group_idx=group))
        elif isinstance(op, p.ClearKeys):
            events.append(p.AllBlocksCleared())
    return events
