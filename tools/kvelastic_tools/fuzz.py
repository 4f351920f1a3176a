"""A structure-aware, seeded fuzzer for the daemon's two doors.

Why structure-aware: random bytes almost never get past msgpack's first byte,
so they only test the outermost check. Most frames here start as a *valid*
message of one of ``protocol.Message``'s types, built from the structs' own
type information (``msgspec.inspect``: fields, bounds, unions, nested
structs), so a new message or field (a ``token``) is fuzzed without anyone
writing a case for it. One thing is then broken on purpose: a boundary
integer, invalid UTF-8, 1,000+ levels of nesting, a wrong type, an unknown or
duplicated field, a cut, a byte flip, an oversize or multi-part frame.

Why seeded: every frame comes from one ``random.Random(seed)``, so a frame
that crashes the daemon is reproduced by the same seed and frame number.
``Fuzzer.frame()`` gives the control socket's messages (a list of parts for
``send_multipart``); ``Fuzzer.channel()`` what one page-channel connection
sends (``kvelastic_tools.bench.fuzzdrive`` drives both, ``kvelastic bench fuzz``
and ``tests/daemon/test_fuzz.py`` use it).

Sequence mode (``Sequences``): frames one at a time test each message's
checks; a daemon's books break in *sequences* of well-formed messages, such
as an engine id registered again while its last registration still waits
for its workers' unmaps. ``Sequences(seed, ...).sessions(client)`` plans what one
client does, session after session: register an engine (its id from a small
pool, so ids are reused, often at once), open its lifeline and its workers'
page channels with or without the right secret, grow, journal (valid, and
hostile but valid: slabs it does not hold, huge block ids, ``AddSlab`` of
any id, many keys), return, answer reclaims, acknowledge maps and unmaps on
time, late or never, and leave (unregister, close abruptly, its lifeline
first, its workers first, a worker killed). Values are type-valid and often
extreme (``fuzzvalues.hostile_ints``). Every choice of a plan comes from the
seed, whatever the daemon answers; ``kvelastic_tools.bench.fuzzseq`` carries plans
out against a real daemon.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import random
import struct
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi

from kvelastic import protocol as p
from kvelastic_tools.fuzzvalues import NAME_CHARS, Slot, ValueBuilder, hostile_ints

KINDS = ("random_bytes", "valid", "mutated", "boundary_int", "invalid_utf8", "deep_nesting", "wrong_type",
         "unknown_field", "truncated", "oversize", "multi_frame")
# Per 1,000 frames: an oversize frame costs 1-2 MiB, the rest a few hundred bytes.
WEIGHTS = {"random_bytes": 120, "valid": 100, "mutated": 200, "boundary_int": 100, "invalid_utf8": 100,
           "deep_nesting": 60, "wrong_type": 100, "unknown_field": 80, "truncated": 100, "oversize": 1,
           "multi_frame": 39}
CHANNEL_KINDS = ("random", "huge_size", "oversized", "partial", "mutated", "wrong_version", "invalid_utf8",
                 "valid_then_garbage", "valid_then_close", "connect_close")


def _struct_info(cls: type) -> mi.StructType:
    """``msgspec.inspect``'s description of the message struct ``cls``."""
    info = mi.type_info(cls)
    if not isinstance(info, mi.StructType):
        raise TypeError(f"{cls!r} is not a msgspec struct")
    return info


def _message_types() -> tuple[type, ...]:
    """The struct types of the ``protocol.Message`` union."""
    info = mi.type_info(p.Message)
    if not isinstance(info, mi.UnionType):
        raise TypeError("protocol.Message is not a union of structs")
    types: list[type] = []
    for t in info.types:
        if not isinstance(t, mi.StructType):
            raise TypeError(f"protocol.Message holds {t!r}, not a struct")
        types.append(t.cls)
    return tuple(types)


MESSAGE_TYPES = _message_types()

BOUNDARY_INTS = (-1, -(2**31), -(2**63), 0, 1, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
# 2**64 and beyond have no msgpack integer: a peer can only send them as floats (or a bignum ext).
BEYOND_INT64 = (msgspec.Raw(b"\xcb" + struct.pack(">d", 2.0**64)), msgspec.Raw(b"\xcb" + struct.pack(">d", 1e300)),
                msgspec.Raw(b"\xc7\x09\x01" + (2**70).to_bytes(9, "big")))
INVALID_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82", b"a\x80b", b"\xf8\x88\x80\x80\x80",
                b"ok\xfe\xfe")
NESTING = (b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\x81\x00")   # array, str-keyed map, array16, int-keyed map
WRONG: dict[str, Any] = {"int": 7, "str": "x", "bytes": b"\x00", "bool": True, "float": 1.5, "none": None,
                         "list": [1, "a"], "dict": {"a": 1}}
_PLACEHOLDER = "\x00fuzz-placeholder\x00"


def _str_bytes(data: bytes) -> bytes:
    """msgpack str header + raw (possibly invalid UTF-8) bytes."""
    return (bytes([0xA0 | len(data)]) if len(data) < 32 else b"\xd9" + bytes([len(data)])) + data


@dataclasses.dataclass(frozen=True)
class ChannelPlan:
    """One page-channel connection: what it sends at once, what it sends a
    moment later (nothing: ``b""``), then it closes."""

    first: bytes
    then: bytes = b""


class Fuzzer:
    """Seeded frames by kind. ``avoid``: names the fuzzer must never produce
    (the legitimate engine's id and namespace), so that a decodable frame never
    acts for it."""

    def __init__(self, seed: int = 0, avoid: tuple[str, ...] = (), weights: dict[str, int] | None = None,
                 hints: dict[type, dict[str, Any]] | None = None) -> None:
        self.rng = random.Random(seed)
        # Field values for half the messages of a type (``daemon_hints``): a
        # registration this daemon accepts, then grows of that engine, reach
        # the allocator's deeper paths; random values rarely get that far.
        self.hints = hints or {}
        self.avoid = frozenset(avoid)
        w = weights or WEIGHTS
        self._kinds = [k for k in KINDS if w.get(k, 0) > 0]
        self._cum = list(itertools.accumulate(w[k] for k in self._kinds))
        self._blob = self.rng.randbytes(2 * p.MAX_MESSAGE_BYTES)
        self._types = {cls: _struct_info(cls) for cls in MESSAGE_TYPES}
        self._names: dict[tuple, list[str]] = {}
        self._cache: dict[type, list[bytes]] = {}

    # ------------------------------------------------------------- messages
    def build(self, cls: type | None = None) -> tuple[Any, list[Slot]]:
        """A valid message of ``cls`` (random type if None) as wire data, and its slots."""
        builder = ValueBuilder(self.rng, self.avoid, self._names)
        holder: list[Any] = [None]
        t = self._types[cls] if cls is not None else self._types[self.rng.choice(MESSAGE_TYPES)]
        hints = self.hints.get(t.cls) if self.hints and self.rng.random() < 0.5 else None
        holder[0] = builder.struct(t, holder, 0, hints)
        return holder, builder.slots

    def valid(self, cls: type | None = None, fresh: bool = True) -> bytes:
        """A valid message's encoding; not ``fresh``: often one of the last 32
        of that type (what byte-level kinds start from, at a tenth of the cost)."""
        if fresh:
            return msgspec.msgpack.encode(self.build(cls)[0][0])
        cls = cls or MESSAGE_TYPES[int(self.rng.random() * len(MESSAGE_TYPES))]
        ring = self._cache.setdefault(cls, [])
        i = int(self.rng.random() * 32)
        if i >= len(ring) or self.rng.random() < 0.2:
            data = self.valid(cls)
            ring.append(data) if i >= len(ring) else ring.__setitem__(i, data)
            return data
        return ring[i]

    def frame(self, kind: str | None = None, cls: type | None = None) -> tuple[str, list[bytes]]:
        """One control-socket message: (its kind, its parts)."""
        rng = self.rng
        kind = kind or rng.choices(self._kinds, cum_weights=self._cum)[0]
        if kind == "random_bytes":
            return kind, [rng.randbytes(rng.choice((0, 1, 2, 5, 16, 64, 300)) if rng.random() < 0.3
                                        else rng.randint(0, 128))]
        if kind == "oversize":
            n = rng.randint(p.MAX_MESSAGE_BYTES + 1, 2 * p.MAX_MESSAGE_BYTES)
            head = self.valid(cls, fresh=False)
            return kind, [head + self._blob[:n - len(head)]]
        if kind == "multi_frame":
            small = ("valid", "mutated", "random_bytes", "truncated")
            return kind, [b"" if rng.random() < 0.1 else self.frame(rng.choice(small), cls)[1][0]
                          for _ in range(rng.randint(2, 4))]
        if kind in ("mutated", "truncated"):
            data = bytearray(self.valid(cls, fresh=False))
            if kind == "truncated":
                return kind, [bytes(data[:rng.randrange(len(data))])]
            for _ in range(rng.randint(1, 4)):
                self._mutate(data)
            return kind, [bytes(data)]
        holder, slots = self.build(cls)
        return kind, [self._break(kind, holder, slots)]

    def _mutate(self, data: bytearray) -> None:
        rng, op = self.rng, self.rng.randrange(5)
        i = rng.randrange(len(data)) if data else 0
        if op == 0 and data:
            data[i] = rng.randrange(256)                      # replace
        elif op == 1 and data:
            data[i] ^= 1 << rng.randrange(8)                  # flip one bit
        elif op == 2:
            data[i:i] = rng.randbytes(rng.randint(1, 4))      # insert
        elif op == 3 and data:
            del data[i:i + rng.randint(1, 4)]                 # delete
        else:
            data[i:i] = data[i:i + rng.randint(1, 16)]        # duplicate a chunk

    def _break(self, kind: str, holder: list[Any], slots: list[Slot]) -> bytes:
        """Encode ``holder[0]`` with one of its slots broken the ``kind`` way."""
        rng = self.rng
        raw = None   # (placeholder str, bytes it becomes): for what msgspec cannot put in a dict key
        of = [s for s in slots if s.kind in {
            "boundary_int": ("int", "key_int"), "invalid_utf8": ("str", "key_str"),
            "deep_nesting": ("list", "dict"), "wrong_type": tuple(WRONG) + ("key_str",),
            "unknown_field": ("dict",), "valid": ()}[kind]]
        if kind == "boundary_int":
            if not of:                                    # req_id left out: put it back
                holder[0]["req_id"] = 0
                of = [Slot(holder[0], "req_id", "int")]
            chosen = rng.sample(of, rng.randint(1, len(of)))
            for s in sorted(chosen, key=lambda s: s.kind == "key_int"):   # values before their keys
                if s.kind == "key_int":
                    _rekey(s, rng.choice(BOUNDARY_INTS))
                else:
                    s.parent[s.key] = rng.choice(BOUNDARY_INTS + BEYOND_INT64)
        elif kind == "invalid_utf8":
            s, bad = rng.choice(of), _str_bytes(rng.choice(INVALID_UTF8))
            if s.kind == "key_str":
                _rekey(s, _PLACEHOLDER)
                raw = (_PLACEHOLDER, bad)
            else:
                s.parent[s.key] = msgspec.Raw(bad)
        elif kind == "deep_nesting":
            r = rng.random()   # mostly just past 1,000 levels; rarely far deeper (100 KiB+ frames)
            depth = rng.choice((1000, 1001, 1500, 2000, 3000, 5000)) if r < 0.99 else 100_000 if r < 0.999 else 400_000
            deep = msgspec.Raw(rng.choice(NESTING) * depth + b"\xc0")
            if of and rng.random() < 0.6:
                s = rng.choice(of)
                s.parent[s.key] = deep
            else:                                         # an unknown field, which decoding must skip
                holder[0][self._name(rng)] = deep
        elif kind == "wrong_type":
            s = rng.choice(of + [Slot(holder, 0, "dict")])
            if s.kind == "key_str":                      # a field name that is not a string
                _rekey(s, rng.choice((7, -1, 2**64 - 1)))
            else:
                s.parent[s.key] = copy.deepcopy(rng.choice([v for k, v in WRONG.items() if k != s.kind]))
        elif kind == "unknown_field":
            s = rng.choice(of)
            d = s.parent[s.key] if rng.random() < 0.5 else holder[0]
            for _ in range(rng.randint(1, 3)):
                if rng.random() < 0.3 and d:              # a field given twice
                    d[_PLACEHOLDER] = copy.deepcopy(rng.choice(list(WRONG.values())))
                    name = rng.choice([k for k in d if k != _PLACEHOLDER])
                    raw = (_PLACEHOLDER, msgspec.msgpack.encode(name))
                else:
                    d[self._name(rng)] = copy.deepcopy(rng.choice(list(WRONG.values()) + [rng.randbytes(8)]))
        data = msgspec.msgpack.encode(holder[0])
        if raw is not None:
            data = data.replace(msgspec.msgpack.encode(raw[0]), raw[1], 1)
        return data

    def _name(self, rng: random.Random) -> str:
        return "".join(rng.choices(NAME_CHARS, k=rng.randint(1, 12))) + "_x"

    # --------------------------------------------------------- page channel
    def hello(self, version: int = p.PROTOCOL_VERSION) -> bytes:
        """A well-formed greeting body (generic: any new Hello field gets a value)."""
        builder = ValueBuilder(self.rng, self.avoid, self._names)
        d = builder.struct(_struct_info(p.Hello), None, None)
        d["version"] = version
        if "rank" in d:
            d["rank"] = self.rng.randint(-1, 3)
        return msgspec.msgpack.encode(d)

    def channel(self, kind: str | None = None) -> tuple[str, ChannelPlan]:
        """One page-channel connection's kind and plan."""
        rng = self.rng
        kind = kind or rng.choice(CHANNEL_KINDS)
        body = self.hello()
        framed = len(body).to_bytes(4, "little") + body
        if kind == "random":
            return kind, ChannelPlan(rng.randbytes(rng.randint(1, 64)))
        if kind == "huge_size":
            return kind, ChannelPlan(rng.randint(4097, 2**32 - 1).to_bytes(4, "little") + rng.randbytes(8))
        if kind == "oversized":
            n = rng.randint(4097, 65536)
            return kind, ChannelPlan(n.to_bytes(4, "little") + self._blob[:n])
        if kind == "partial":
            return kind, ChannelPlan(framed[:rng.randrange(1, len(framed))])
        if kind == "mutated":
            data = bytearray(body)
            for _ in range(rng.randint(1, 3)):
                self._mutate(data)
            return kind, ChannelPlan(len(data).to_bytes(4, "little") + bytes(data))
        if kind == "wrong_version":
            body = self.hello(rng.choice((0, 2, -1, 2**63 - 1)))
            return kind, ChannelPlan(len(body).to_bytes(4, "little") + body)
        if kind == "invalid_utf8":
            d = msgspec.msgpack.decode(body)
            d["engine_id"] = msgspec.Raw(_str_bytes(rng.choice(INVALID_UTF8)))
            body = msgspec.msgpack.encode(d)
            return kind, ChannelPlan(len(body).to_bytes(4, "little") + body)
        if kind == "valid_then_garbage":
            return kind, ChannelPlan(framed, rng.randbytes(rng.randint(1, 256)))
        if kind == "valid_then_close":
            return kind, ChannelPlan(framed)
        return kind, ChannelPlan(b"")


HINT_TOKEN = b"kvelastic-fuzz-hinted-secret-32b"     # 32 bytes


def daemon_hints(page_size: int, pid: int) -> dict[type, dict[str, Any]]:
    """Hints for a daemon of ``page_size`` pages: worker-less engines of one
    page per slab (they need no page channel to be granted memory), claiming
    process ``pid``, that grow one slab at a time, with a secret of the
    length a daemon asks of a new engine (one for all: a registration of an
    id again is then a reconnection). Only fields the protocol still has are
    used, so a changed protocol needs no change here."""
    token = HINT_TOKEN
    wanted: dict[type[msgspec.Struct], dict[str, Any]] = {
        p.RegisterEngine: dict(version=p.PROTOCOL_VERSION, pid=pid, page_size=page_size, pages_per_worker=1,
                               num_workers=0, blocks_per_slab=4, block_bytes=page_size // 4, device="",
                               min_bytes=0, max_bytes=0, held=[], occupancy={}, token=token),
        p.RegisterWorker: dict(version=p.PROTOCOL_VERSION, rank=0, pid=pid, device="", mapped=[], token=token),
        p.Grow: dict(slabs=1, demand=True)}
    return {cls: {k: v for k, v in hints.items() if k in cls.__struct_fields__} for cls, hints in wanted.items()}


def _rekey(slot: Slot, new: Any) -> None:
    """Rename the dict key of ``slot`` (a field name or a map key)."""
    d = slot.parent
    if slot.key in d:
        d[new] = d.pop(slot.key)


# ----------------------------------------------------------- sequence mode
# Each kind of step a session takes, with its weight.
ACTIONS = {"grow": 20, "journal": 15, "journal_hostile": 10, "return": 12, "heartbeat": 4, "wait": 12,
           "impostor": 6, "operator": 3, "status": 2, "reregister": 4, "extra_lifeline": 3, "hostile_hello": 5,
           "busy": 2, "close_worker": 2, "kill_worker": 3, "diverge": 2}
# How a session ends. ``lifeline_first`` and ``unregister_linger`` leave its
# workers behind for a while (unmaps due), which is when a reused id hurts.
ENDINGS = {"unregister": 20, "close_all": 15, "lifeline_first": 25, "unregister_linger": 15, "silent": 8,
           "kill9": 10, "workers_first": 7}
ACKS = {"on_time": 62, "late": 16, "never": 8, "error": 5, "twice": 5, "wrong_slab": 4}
# Unmaps are where a departing engine waits: more of them late or never.
UNMAP_ACKS = {"on_time": 50, "late": 25, "never": 13, "twice": 5, "wrong_slab": 4, "error": 3}
RECLAIM_ANSWERS = {"give": 40, "refuse": 10, "some": 10, "late": 10, "never": 8, "hostile_cached": 10,
                   "wrong_id": 6, "extra": 6}
NAMESPACES = ("seq-ns-a", "seq-ns-b", "seq-ns-c")


def _pick(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """One worker of a session's engine."""

    rank: int            # the rank its RegisterWorker claims
    hello_rank: int      # the rank its page channel's hello shows
    channel: str         # "right" (its engine's secret), "wrong_token", "no_token", "none", "after" (late)
    register_token: str  # "right", "wrong"
    maps: str            # how it acknowledges a MapSlab: one of ``ACKS``
    unmaps: str          # and an UnmapSlab
    delay: float         # how late a late acknowledgement is (seconds)
    fds: str             # page descriptors: "close" them, "keep" them (until it goes), leave them "unread"
    process: bool        # a real ``WorkerClient`` in a child process (acks on time; may be killed -9)


@dataclasses.dataclass(frozen=True)
class SessionPlan:
    """What one client does with one engine registration, from start to end."""

    client: int
    index: int
    seed: int            # of the session's own choices (which slab, which key), made as it runs
    engine_id: str
    namespace: str
    fields: dict[str, Any]   # RegisterEngine's other fields (geometry, limits, held, pid, device)
    hostile: tuple[str, ...]  # the fields given an extreme value
    token: bytes         # the engine's own secret ("" or short: refused by a daemon that wants 16+ bytes)
    lifeline: str        # "before" (registering), "after", "none", "wrong_token", "twice"
    workers: tuple[WorkerPlan, ...]
    reclaims: str        # how it answers a Reclaim: one of ``RECLAIM_ANSWERS``
    actions: tuple[tuple[str, int], ...]   # (action, its own seed)
    ending: str
    linger: float        # seconds its workers (or the whole engine, when silent) stay after the ending
    pattern: str = ""    # a session of a planned pair ("reuse_race:1", "reuse_race:2")


class Sequences:
    """Seeded session plans for the clients of a sequence fuzz. ``ids``: the
    pool of engine ids (few, so they are reused); ``victims``: ids that
    impostors and hostile hellos aim at besides the pool's (the legitimate
    engine's), never registered by the fuzz."""

    def __init__(self, seed: int, page_size: int, budget_bytes: int, ids: int = 5,
                 victims: tuple[str, ...] = (), ack_timeout: float = p.ACK_TIMEOUT) -> None:
        self.seed, self.page_size, self.budget = seed, page_size, budget_bytes
        self.ids = tuple(f"seq-{i}" for i in range(ids))
        self.victims = victims
        self.ack_timeout = ack_timeout
        self.extreme = hostile_ints(page_size, budget_bytes)

    def sessions(self, client: int) -> Iterator[SessionPlan]:
        """Client ``client``'s sessions, in order (endless)."""
        rng = random.Random(f"{self.seed}/sequences/{client}")
        last = rng.choice(self.ids)
        index = itertools.count()
        while True:
            if rng.random() < 0.15:
                yield from self.reuse_race(rng, client, index, last)
            else:
                plan = self.session(rng, client, next(index), last)
                last = plan.engine_id
                yield plan

    def reuse_race(self, rng: random.Random, client: int, index: Iterator[int],
                   engine_id: str) -> tuple[SessionPlan, SessionPlan]:
        """The reviewer's sequence, planned: an engine leaves while its worker
        holds back its unmaps (late or never, then its channel stays open a
        while); its id is registered again at once, and that engine leaves
        too, the first one still departing."""
        page = self.page_size
        sane = dict(pid=os.getpid(), pages_per_worker=1, num_workers=1, blocks_per_slab=4, block_bytes=page // 4,
                    device="", block_tokens=16, key_group_suffix=False, min_bytes=0, max_bytes=0, held=[],
                    occupancy={})
        worker = dataclasses.replace(self._worker(rng, 0, 1), rank=0, hello_rank=0, channel="right",
                                     register_token="right", maps="on_time", unmaps=rng.choice(("late", "never")),
                                     fds="close", process=False)
        first = dataclasses.replace(
            self.session(rng, client, next(index), engine_id), engine_id=engine_id, fields=sane, hostile=(),
            token=rng.randbytes(32), lifeline="before", workers=(worker,),
            actions=(("grow", rng.getrandbits(32)), ("journal", rng.getrandbits(32))),
            ending=rng.choice(("lifeline_first", "unregister_linger")),
            linger=rng.uniform(1.0, 2.5) * self.ack_timeout, pattern="reuse_race:1")
        second = dataclasses.replace(
            self.session(rng, client, next(index), engine_id), engine_id=engine_id, token=rng.randbytes(32),
            lifeline="before", actions=(("grow", rng.getrandbits(32)),),
            ending=rng.choice(("close_all", "lifeline_first", "unregister")), linger=0.0, pattern="reuse_race:2")
        return first, second

    def session(self, rng: random.Random, client: int, index: int, last: str) -> SessionPlan:
        engine_id = last if rng.random() < 0.6 else rng.choice(self.ids)
        if self.victims and rng.random() < 0.03:
            engine_id = rng.choice(self.victims)        # someone else's: refused without its secret
        fields, hostile = self._registration(rng)
        r = rng.random()
        token = rng.randbytes(rng.randint(16, 64)) if r < 0.8 else b"" if r < 0.9 else rng.randbytes(rng.randint(1, 15))
        lifeline = rng.choices(("before", "after", "none", "wrong_token", "twice"), (65, 10, 10, 10, 5))[0]
        n = fields["num_workers"]
        workers = tuple(self._worker(rng, rank, n) for rank in range(min(n, 3)))
        if rng.random() < 0.2:        # brief: it grows and goes, so that its id comes back while it departs
            actions: tuple[tuple[str, int], ...] = (("grow", rng.getrandbits(32)),)
            ending = rng.choice(("close_all", "lifeline_first", "unregister", "kill9"))
        else:
            first = (("grow", rng.getrandbits(32)),) if rng.random() < 0.7 else ()
            actions = first + tuple((_pick(rng, ACTIONS), rng.getrandbits(32)) for _ in range(rng.randint(1, 10)))
            ending = _pick(rng, ENDINGS)
        linger = rng.choice((0.0, 0.2, 0.5, 1.0)) * self.ack_timeout + rng.random() * self.ack_timeout
        return SessionPlan(client, index, rng.getrandbits(32), engine_id, rng.choice(NAMESPACES), fields, hostile,
                           token, lifeline, workers, _pick(rng, RECLAIM_ANSWERS), actions, ending, linger)

    def _registration(self, rng: random.Random) -> tuple[dict[str, Any], tuple[str, ...]]:
        page = self.page_size
        workers = rng.choice((0, 1, 1, 2))
        per_worker = rng.choice((1, 1, 2))
        blocks = rng.choice((4, 8, 16))
        fields: dict[str, Any] = dict(
            pid=os.getpid(), pages_per_worker=per_worker, num_workers=workers, blocks_per_slab=blocks,
            block_bytes=per_worker * page // blocks, device="", block_tokens=16,
            key_group_suffix=rng.random() < 0.5, min_bytes=0, max_bytes=0, held=[], occupancy={},
            pages_per_region=per_worker if rng.random() < 0.2 else 1)    # runs of pages (MLA's blocks)
        if rng.random() < 0.15:
            fields["min_bytes"] = rng.randint(1, 3) * page * per_worker * max(1, workers)
        if rng.random() < 0.15:
            fields["max_bytes"] = rng.randint(1, 4) * page * per_worker * max(1, workers)
        if rng.random() < 0.08:       # adoption: slabs it says it held under an earlier daemon
            fields["held"] = sorted(rng.sample(range(6), rng.randint(1, 3)))
            fields["occupancy"] = {s: [0, 0, blocks] for s in fields["held"] if rng.random() < 0.5}
        hostile: list[str] = []
        if rng.random() < 0.35:       # one to three fields at an extreme
            for name in rng.sample(sorted(self.extreme.keys() & fields.keys()), rng.randint(1, 3)):
                fields[name] = rng.choice(self.extreme[name])
                hostile.append(name)
            if "blocks_per_slab" in hostile and rng.random() < 0.5:
                fields["block_bytes"] = 1              # 2**40 blocks of one byte: all in one page, it says
        if rng.random() < 0.03:
            fields["device"] = rng.choice(("nope", "1", "0"))
            hostile.append("device")
        return fields, tuple(hostile)

    def _worker(self, rng: random.Random, rank: int, workers: int) -> WorkerPlan:
        claimed = rank if rng.random() < 0.92 else rng.choice((-1, workers, *self.extreme["rank"]))
        hello = claimed if rng.random() < 0.9 else rng.choice((-1, -2, claimed + 1, *self.extreme["rank"]))
        return WorkerPlan(
            rank=claimed, hello_rank=hello,
            channel=rng.choices(("right", "wrong_token", "no_token", "none", "after"), (85, 4, 4, 3, 4))[0],
            register_token="right" if rng.random() < 0.93 else "wrong",
            maps=_pick(rng, ACKS), unmaps=_pick(rng, UNMAP_ACKS),
            delay=round(rng.uniform(0.1, 2.5) * self.ack_timeout, 3),
            fds=rng.choices(("close", "keep", "unread"), (90, 7, 3))[0],
            process=rng.random() < 0.12)
