"""Every message between engines, workers, the CLI and the daemon.

Transport: ZMQ (ROUTER in the daemon, DEALER in clients) over ``ipc://``,
one msgpack-encoded tagged ``msgspec.Struct`` per frame. Every request carries
``req_id``; the daemon answers each with a reply of the same ``req_id``
(``Ok``, a specific reply, or ``Error``). The daemon also sends unsolicited
commands (``Reclaim``/``ClearIndex`` to engines, ``MapSlab``/``UnmapSlab`` to
workers) with request ids of its own; clients answer with ``ReclaimDone``,
``Mapped`` and ``Unmapped``. ``Journal`` and ``Heartbeat`` are notifications:
they are answered only with an ``Error``.

Page descriptors never travel here: they go over the AF_UNIX channel of
``kvelastic.vmm.fdchannel``, each batch with the ``MapSlab`` that names them
(encoded as here); an ``UnmapSlab`` goes there too, as a batch without
pages. A client opens that channel with a ``Hello`` (who it is);
a worker sends its ``Mapped`` and ``Unmapped`` back on it (``<u32 size>``
then the message; ZMQ still takes them too), an engine nothing; its closing
tells the daemon the peer is gone.

Below it: ``names.py`` (the bounds on names), ``status_report.py`` (what
``Status`` answers). Beside it: ``kv_events.py``, the KV events the daemon
publishes in vLLM's wire format.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from kvelastic.core.journal import (
    ADD_SLAB,
    CLEAR,
    DEMOTE,
    DONE,
    LABEL,
    PROMOTE,
    REMOVE,
    REMOVE_SLAB,
    STEP,
    STORE,
    BlockOp,
    ClearOp,
    KeyOp,
    LabelOp,
    Op,
    SlabOp,
    StepOp,
)
from kvelastic.names import Name, ShownName
from kvelastic.status_report import StatusReport

# 2: a worker's commands and acks on its page channel; 3: an engine's journal on its lifeline;
# 4: demoted blocks in the journal (DemoteBlock, PromoteBlock)
PROTOCOL_VERSION = 5
MAX_MESSAGE_BYTES = 1 << 20

# Timing both sides rely on (seconds). The daemon's deadlines are configurable
# (``config.py``); these are their defaults.
HEARTBEAT_INTERVAL = 0.5     # an engine's heartbeat
HEARTBEAT_TIMEOUT = 1.5      # without one for this long an engine is dead
RECLAIM_TIMEOUT = 1.0        # an owner that does not answer a reclaim in time refuses it
ACK_TIMEOUT = 5.0            # every worker maps or unmaps a slab within this, or its engine fails
GROW_TIMEOUT = 5.0           # every grow is answered within this (with what could be granted)
HELLO_TIMEOUT = 2.0          # a page channel's greeting must be complete within this
REGISTER_TIMEOUT = 10.0      # a page channel whose engine is not registered by then is closed
SEND_PAGES_TIMEOUT = 1.0     # a worker takes its page descriptors within this
IDLE_GRACE = 5.0             # an engine inactive this long is idle (configurable)
HOLD_DOWN = 2.0              # memory moved away from an engine is not moved back within this (configurable)
ORPHAN_CACHE_TTL = 600.0     # a departed engine's cache is kept this long for its namespace (configurable)
THRASH_WINDOW = 1.0          # a move back within this of a move away counts as thrash


class Reason(str, enum.Enum):
    """Why the daemon refused a message: ``Error.reason``, the label of
    ``kvelastic_rejected_messages_total``, and what clients and tests match on."""

    MALFORMED = "malformed"              # undecodable frame
    OVERSIZE = "oversize"                # frame over MAX_MESSAGE_BYTES
    UNEXPECTED = "unexpected"            # not a request
    INTERNAL = "internal"                # a bug in the daemon (logged with a traceback)
    UNKNOWN_ENGINE = "unknown_engine"
    UNKNOWN_DEVICE = "unknown_device"
    VERSION = "version"                  # protocol version mismatch
    GEOMETRY = "geometry"                # page size, slab shape
    ENGINE_EXISTS = "engine_exists"      # the id is registered by another process
    LIMIT = "limit"                      # min/max memory out of range
    BAD_RANK = "bad_rank"
    NO_CHANNEL = "no_channel"            # a worker registered before opening its page channel
    UNKNOWN_TARGET = "unknown_target"    # invalidate of an unknown engine or namespace
    BAD_JOURNAL = "bad_journal"
    BAD_REQUEST = "bad_request"
    UNEXPECTED_ACK = "unexpected_ack"
    NOT_HELD = "not_held"                # a return of a slab the engine does not hold
    BAD_HELLO = "bad_hello"              # a page channel's greeting was invalid or too slow
    BAD_ADOPTION = "bad_adoption"        # a re-registration's held slabs do not fit
    BUSY = "busy"                        # too many grows pending for one engine
    NOT_OWNER = "not_owner"              # names an engine that another connection registered
    BAD_TOKEN = "bad_token"              # an engine's secret missing or wrong
    NOT_ALLOWED = "not_allowed"          # a page channel from a user outside the daemon's user and group
    ENGINE_GONE = "engine_gone"          # not a rejection: the answer to the grows of an engine that left
    NOT_OPERATOR = "not_operator"        # a tenant asked what only an operator may (limits, invalidate, a minimum)
    CHANNEL_LIMIT = "channel_limit"      # too many page channels or lifelines open for one user or engine


# Bounds on what a client may send: everything the daemon keeps per engine is
# proportional to what it holds, not to what it says.
Key = Annotated[bytes, msgspec.Meta(max_length=256)]                    # a prefix-cache key
# A key's label (core/journal.py): opaque to the daemon, at most 4 KiB (a
# block's token ids and parent hash, as the vLLM adapter packs them; a larger
# one is not sent: its block goes unlabelled).
MAX_LABEL_BYTES = 4096
Label = Annotated[bytes, msgspec.Meta(max_length=MAX_LABEL_BYTES)]
Stats = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], int], msgspec.Meta(max_length=64)]
# An engine's registration secret: given to it over its own connection, and
# shown by its workers (RegisterWorker, the page channel's Hello) and by its
# own re-registrations. Nobody else can act for that engine without it.
Token = Annotated[bytes, msgspec.Meta(max_length=64)]
SlabIds = Annotated[list[int], msgspec.Meta(max_length=1 << 16)]        # more slabs than any device has
MIN_TOKEN = 16               # bytes of a new engine's secret (it chooses it: ``EngineClient``)
MAX_WORKERS = 1024           # workers (ranks) of one engine
# A page channel's rank: a worker's, or -1 for the engine's own lifeline.
Rank = Annotated[int, msgspec.Meta(ge=-1, lt=MAX_WORKERS)]


class Msg(msgspec.Struct, tag=True, kw_only=True, array_like=False):
    req_id: int = 0


# ----------------------------------------------------------- engine -> daemon
class RegisterEngine(Msg):
    version: int
    engine_id: Name
    pid: int
    namespace: Name
    page_size: int
    pages_per_worker: int        # pages of one slab in one worker's arena
    num_workers: int             # workers that map every slab (TP ranks); 0: none
    blocks_per_slab: int
    block_bytes: int
    device: str = ""             # the daemon's device name ("0", "1", ...); "": its first
    block_tokens: int = 0        # tokens per block (for KV events)
    key_group_suffix: bool = False  # keys are vLLM's hash + 4-byte group id
    min_bytes: int = 0           # guaranteed: never reclaimed below this
    max_bytes: int = 0           # 0: no cap beyond the budget
    held: SlabIds = []           # slab ids still held (re-register after a daemon restart)
    # Its cache is its own: its weights may differ from its namespace's
    # checkpoint (``Diverge``, or KVELASTIC_PRIVATE_CACHE), so its slabs are
    # never handed on or kept, and it adopts nothing.
    private: bool = False
    # Consecutive pages of a slab in one region of a worker's arena: more
    # than 1 when a block's size is no divisor of a page (MLA's 576-wide
    # latents), so only several pages hold whole blocks. Divides pages_per_worker.
    pages_per_region: int = 1
    occupancy: dict[int, tuple[int, int, int]] = {}
    # Its secret, chosen by the engine (at least MIN_TOKEN random bytes) and
    # shown first in its lifeline's hello: only the process that knows it can
    # keep the engine alive, re-register it or act as its workers.
    token: Token = b""


class RegisterWorker(Msg):
    version: int
    engine_id: Name
    rank: int
    pid: int
    device: str = ""             # where this rank's pages live; "": the engine's device
    mapped: SlabIds = []         # slab ids mapped (re-register after a daemon restart)
    token: Token = b""           # its engine's secret


class Grow(Msg):
    engine_id: Name
    slabs: int                   # how many slabs wanted
    # Demand: the scheduler cannot admit or continue a request without these
    # slabs; only demand may reclaim from other engines. Otherwise a reserve
    # refill (watermark prefetch), served from free memory and budget only.
    demand: bool = False


class Return(Msg):
    engine_id: Name
    slabs: SlabIds               # already taken back by the engine's pool


# Journal ops on the wire: tagged arrays (``["store", key, block]``), so that
# decoding checks every op's shape and types and a bad journal is refused
# whole before anything is applied. ``core()`` gives the pool's own tuple.
BlockId = Annotated[int, msgspec.Meta(ge=0)]


class StoreKey(msgspec.Struct, tag="store", array_like=True, frozen=True):
    key: Key
    block: BlockId

    def core(self) -> KeyOp:
        return (STORE, self.key, self.block)


class RemoveKey(msgspec.Struct, tag="remove", array_like=True, frozen=True):
    key: Key
    block: BlockId

    def core(self) -> KeyOp:
        return (REMOVE, self.key, self.block)


class AddSlab(msgspec.Struct, tag="add_slab", array_like=True, frozen=True):
    slab: BlockId

    def core(self) -> SlabOp:
        return (ADD_SLAB, self.slab)


class RemoveSlab(msgspec.Struct, tag="remove_slab", array_like=True, frozen=True):
    slab: BlockId

    def core(self) -> SlabOp:
        return (REMOVE_SLAB, self.slab)


class ClearKeys(msgspec.Struct, tag="clear", array_like=True, frozen=True):
    def core(self) -> ClearOp:
        return (CLEAR,)


StepNumber = Annotated[int, msgspec.Meta(ge=1)]


class StepBegun(msgspec.Struct, tag="step", array_like=True, frozen=True):
    """Keys stored from here on belong to this model step (written once it is done)."""
    step: StepNumber

    def core(self) -> StepOp:
        return (STEP, self.step)


class StepDone(msgspec.Struct, tag="done", array_like=True, frozen=True):
    """Every step up to this one finished: the blocks keyed in them hold their KV."""
    step: StepNumber

    def core(self) -> StepOp:
        return (DONE, self.step)


class LabelBlock(msgspec.Struct, tag="label", array_like=True, frozen=True):
    """The label of the key just stored in this block (travels with the key)."""
    block: BlockId
    label: Label

    def core(self) -> LabelOp:
        return (LABEL, self.block, self.label)


class DemoteBlock(msgspec.Struct, tag="demote", array_like=True, frozen=True):
    """The block is next to be evicted: its key stays, its KV is not kept, and
    its ``RemoveKey`` comes unsealed (``core/journal.py``)."""
    block: BlockId

    def core(self) -> BlockOp:
        return (DEMOTE, self.block)


class PromoteBlock(msgspec.Struct, tag="promote", array_like=True, frozen=True):
    """A demoted block was hit again: its KV, unchanged, may be kept again."""
    block: BlockId

    def core(self) -> BlockOp:
        return (PROMOTE, self.block)


JournalOp = StoreKey | RemoveKey | AddSlab | RemoveSlab | ClearKeys | StepBegun | StepDone | LabelBlock | \
    DemoteBlock | PromoteBlock
# Each class takes the op's fields after the code, in order.
_WIRE_OP: dict[str, Any] = {   # code -> its JournalOp class
    STORE: StoreKey, REMOVE: RemoveKey, ADD_SLAB: AddSlab, REMOVE_SLAB: RemoveSlab, CLEAR: ClearKeys,
    STEP: StepBegun, DONE: StepDone, LABEL: LabelBlock, DEMOTE: DemoteBlock, PROMOTE: PromoteBlock}


def journal_ops(ops: Sequence[Op]) -> list[JournalOp]:
    """The core pool's journal tuples as wire ops (keys must already be bytes)."""
    return [_WIRE_OP[op[0]](*op[1:]) for op in ops]


# The core pool's op codes are these wire ops' tags: an op tuple with a bytes
# key encodes to the very bytes of its wire op (``JournalFrame``).
assert all(cls.__struct_config__.tag == code for code, cls in _WIRE_OP.items())


class Journal(Msg):
    engine_id: Name
    ops: Annotated[list[JournalOp], msgspec.Meta(max_length=20_000)]   # the client sends larger journals in parts
    occupancy: dict[int, tuple[int, int, int]]
    stats: Stats = {}            # cumulative pool counters (lookups, hits, evictions_*)
    # Answer with Ok once applied: the engine is about to run a step that may
    # rewrite blocks whose keys this journal drops (see ``EngineClient.seal_step``).
    sync: bool = False
    # The last ``TierCopied`` ticket the engine heard of when it took this
    # journal: every drop of a block made before it heard is in this journal
    # or an earlier one (docs/tier.md, "Source B").
    tier_ack: int = 0
    # The last ``ClearIndex.scope`` the engine applied when it took this journal.
    scope: int = 0


class JournalFrame(Msg, tag="Journal"):
    """A ``Journal`` as an engine sends it, the same bytes on the wire: its
    ops are the core pool's tuples as they stand (keys already bytes), which
    encode as the tagged arrays ``Journal`` decodes, so shipping a journal
    builds no object per op. Send-only: the daemon decodes a ``Journal``."""
    engine_id: str
    ops: list[tuple[Any, ...]]
    occupancy: dict[int, tuple[int, int, int]]
    stats: dict[str, int] = {}
    sync: bool = False
    tier_ack: int = 0
    scope: int = 0


class Heartbeat(Msg):
    engine_id: Name


class Unregister(Msg):
    engine_id: Name


class Diverge(Msg):
    """The engine's weights may have changed in memory (its prefix cache was
    reset, a collective RPC ran, it slept): from now on it is alone in
    ``namespace``, a fresh one it chose (the checkpoint's namespace with a
    random suffix), and private. Nothing it caches meets an engine of the
    checkpoint again, in either direction."""
    engine_id: Name
    namespace: Name
    reason: Annotated[str, msgspec.Meta(max_length=64)] = ""


class Busy(Msg):
    """A worker is inside a model step and holds these slabs' unmaps until it
    ends (invariant 5): their acknowledgement deadline is pushed back. Sent
    again while the step runs; a frozen worker sends nothing and misses it."""
    engine_id: Name
    rank: int
    slabs: SlabIds


# ------------------------------------------------ the node's tier (docs/tier.md)
MAX_TIER_KEYS = 4096         # keys of one TierLookup


class TierLookup(Msg):
    """Pin the longest run of ``keys`` (from the first) the tier holds for the
    engine's namespace (its registration's, never named here) under a lease."""
    engine_id: Name
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_TIER_KEYS)]


class TierFetch(Msg):
    """Bytes of block ``block`` of a lease, from ``offset`` (a ``TierData``)."""
    engine_id: Name
    lease: Annotated[int, msgspec.Meta(ge=0)]
    block: Annotated[int, msgspec.Meta(ge=0, lt=MAX_TIER_KEYS)]
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0


class TierRelease(Msg):
    """The lease's blocks not fetched yet are not wanted: unpinned."""
    engine_id: Name
    lease: Annotated[int, msgspec.Meta(ge=0)]


# ------------------------------------------- client answers to daemon commands
class CachedBlock(msgspec.Struct, array_like=True, frozen=True):
    """A cached block of a slab, by its place in the slab (``block_id %
    blocks_per_slab``), with its prefix-cache key and the key's label."""
    offset: Annotated[int, msgspec.Meta(ge=0)]
    key: Key
    label: Label = b""


# A slab's cached blocks, oldest first (LRU order): what travels with a slab
# handed from one engine to another of the same namespace.
SlabCache = Annotated[list[CachedBlock], msgspec.Meta(max_length=1 << 12)]


class ReclaimDone(Msg):
    engine_id: Name
    given: list[int]
    refused: list[int]
    # Given slabs' cached blocks, as the engine had them when it let go; the
    # daemon hands them on with the pages to an engine of the same namespace.
    cached: dict[int, SlabCache] = {}


class Mapped(Msg):
    engine_id: Name
    rank: int
    slab: int
    error: str = ""              # non-empty: the worker could not map it


class Unmapped(Msg):
    engine_id: Name
    rank: int
    slab: int


# ----------------------------------------------------- operator (CLI) requests
class Status(Msg):
    pass


class SetLimit(Msg):
    engine_id: ShownName         # as ``status`` shows it
    min_bytes: int
    max_bytes: int


class Invalidate(Msg):
    target: ShownName            # a namespace or an engine id (a tenant's: its own, with or without @uid<N>)


# ---------------------------------------------------------- daemon -> clients
class Ok(Msg):
    pass


class Error(Msg):
    reason: str                  # machine-readable, also the metric label
    message: str


class Invalidated(Msg):
    """The answer to ``Invalidate``: engines told to clear their index, and
    blocks of kept cache (departed engines') dropped, and blocks of the
    node's tier (``KVELASTIC_TIER_DIR``) dropped."""
    engines: int
    kept_blocks: int
    tier_blocks: int = 0


class Registered(Msg):
    engine_id: Name
    budget_bytes: int
    page_size: int
    max_slabs: int               # virtual capacity of the engine, in slabs
    pages_per_worker: int = 1    # a worker's arena: page_size * max_slabs * pages_per_worker
    token: Token = b""           # to an engine: its secret (keep it; give it to its workers)
    idle_grace: float = IDLE_GRACE  # to an engine: inactive this long, it is idle (its reserve decays)
    # To an engine: its namespace's secret root for block hashes (vLLM's
    # NONE_HASH seed). The same for every engine of the namespace on this
    # node, so their hashes agree; unknown outside it, so nobody can predict them.
    hash_seed: str = ""
    # To an engine: how long the daemon keeps a departed engine's cache (0:
    # not at all). When it does, the engine has its journal acknowledged
    # before a step rewrites a block whose key it dropped.
    orphan_ttl: float = 0.0
    # To a worker: the daemon's deadline for each map and unmap ack; a worker
    # in a longer step says ``Busy`` well within it.
    ack_timeout: float = ACK_TIMEOUT
    # To an engine: the node has a tier fed from running engines' evictions
    # (source B): under pressure, demote the next blocks to be evicted ahead
    # (``DEMOTE``) and answer ``TierCopied``, whatever ``orphan_ttl`` is.
    tier: bool = False
    # To an engine: the last ``ClearIndex.scope`` it is known to have applied
    # (a re-registration with one still due gets that ``ClearIndex`` again).
    scope: int = 0


class Granted(Msg):
    slabs: list[int]
    # Slabs handed on by an engine of the same namespace, with their KV: the
    # receiver adopts these blocks as cached (their pages were not zeroed).
    cached: dict[int, SlabCache] = {}


class Reclaim(Msg):
    slabs: list[int]


class Failed(Msg):
    """To an engine: the daemon failed it (a worker missed a deadline). Its
    pages stay quarantined until its processes are gone; it must restart."""
    reason: str


class ClearIndex(Msg):
    """To an engine: drop every key (an invalidation). ``scope`` counts its
    clears; until a journal carries it back (``Journal.scope``), the keys
    journals name may be of before, and none is kept, copied or handed on."""
    scope: int = 0


class MapSlab(Msg):
    slab: int
    pages: list[tuple[int, int]]   # (page id, arena offset); fds arrive on the fd channel


class UnmapSlab(Msg):
    slab: int
    offsets: list[int]


class TierPinned(Msg):
    """The answer to ``TierLookup``: the lease (0: nothing found) and the size
    of each block pinned, the first keys' in order."""
    lease: int
    nbytes: list[int]


class TierData(Msg):
    """Bytes ``offset`` on of a block of ``size`` bytes (the last chunk ends
    at ``size``); ``size`` -1: not served (it failed its check and was
    dropped, or its namespace was invalidated since the lookup)."""
    lease: int
    block: int
    offset: int
    size: int
    data: bytes


class TierCopied(Msg):
    """To an engine: the daemon copied the blocks that its journals marked
    ``DEMOTE``, up to this ``ticket``, into the tier's staging. Its next
    journal carries the ticket back (``Journal.tier_ack``); a copied block
    that journal or an earlier one drops may have been rewritten while it was
    read, and is discarded; the others are written to the tier."""
    ticket: int


class StatusReply(Msg):
    status: StatusReport


Message = (
    RegisterEngine | RegisterWorker | Grow | Return | Journal | Heartbeat | Unregister | Busy | Diverge
    | ReclaimDone | Mapped | Unmapped | Status | SetLimit | Invalidate | TierLookup | TierFetch | TierRelease
    | Ok | Error | Invalidated | Registered | Granted | Reclaim | Failed | ClearIndex | MapSlab | UnmapSlab
    | StatusReply | TierPinned | TierData | TierCopied
)

def fd_socket_path(socket_path: str) -> str:
    """The AF_UNIX page channel lives beside the ZMQ socket."""
    return socket_path + ".fd"


def keeper_socket_path(socket_path: str) -> str:
    """The keeper of the daemon's pages (``kvelastic keeper``) listens beside it too."""
    return socket_path + ".keeper"


class Hello(msgspec.Struct):
    version: int
    engine_id: Name
    rank: Rank                   # worker rank, or -1 for the engine's lifeline
    # Its engine's secret: a lifeline or page channel counts for the engine
    # only with it (descriptors go only to such a channel).
    token: Token = b""


def write_hello(sock: socket.socket, engine_id: str, rank: int, token: bytes = b"") -> None:
    data = msgspec.msgpack.encode(Hello(PROTOCOL_VERSION, engine_id, rank, token))
    sock.sendall(len(data).to_bytes(4, "little") + data)


def read_hello(sock: socket.socket) -> Hello:
    size = int.from_bytes(_recv_exact(sock, 4), "little")
    if size > 4096:
        raise ValueError(f"hello of {size} bytes")
    hello = msgspec.msgpack.decode(_recv_exact(sock, size), type=Hello)
    if hello.version != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {hello.version}, expected {PROTOCOL_VERSION}")
    return hello


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ValueError("peer closed during hello")
        data += chunk
    return data


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Msg:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on a malformed frame."""
    return _decoder.decode(data)
