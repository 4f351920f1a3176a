"""Engines and workers with the daemon: registration, memory (grows, returns,
reclaims, grants), liveness, and the slabs each worker maps.

Besides its replies the daemon sends commands of its own, with request ids
of its own: ``Reclaim``/``Drain``/``ClearIndex`` to engines, ``MapSlab``/``UnmapSlab``
to workers (over the page channel, ``channel.py``); clients answer with
``ReclaimDone``, ``Mapped`` and ``Unmapped``. ``Heartbeat`` is a
notification: it is answered only with an ``Error``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvelastic.names import Name
from kvelastic.protocol.base import ACK_TIMEOUT, DRAIN_SECONDS, IDLE_GRACE, Key, Label, Msg, Token

SlabIds = Annotated[list[int], msgspec.Meta(max_length=1 << 16)]        # more slabs than any device has


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
    # Of those, the ones no step can still write (``SlabPool.settled``): their
    # workers unmap them at once, not at the end of a step (``UnmapSlab.at_once``).
    settled: SlabIds = []


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
    settled: SlabIds = []        # given slabs no step can still write (as ``Return.settled``)


class Mapped(Msg):
    engine_id: Name
    rank: int
    slab: int
    error: str = ""              # non-empty: the worker could not map it


class Unmapped(Msg):
    engine_id: Name
    rank: int
    slab: int


# ---------------------------------------------------------- daemon -> clients
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


class Drain(Msg):
    """To an engine over its fair share while another's demand goes unmet:
    place no new block in these slabs, keep none of their blocks cached, and
    give each back (``Return``) once no block in it is live; after
    ``seconds`` the ones still held are the engine's to use again. Nothing
    is answered (running requests are never cut short: they finish first)."""
    slabs: SlabIds
    seconds: float = DRAIN_SECONDS


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
    """To a worker: let go of a slab's pages, at the end of the step that
    runs (a safe point), or ``at_once`` if its engine said no step can
    still write them (settled): a grant then waits on no model step."""
    slab: int
    offsets: list[int]
    at_once: bool = False
