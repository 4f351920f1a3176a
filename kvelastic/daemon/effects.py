"""What the allocator asks the loop to do: the daemon's only ways to touch the world.

The allocator (``allocator.py``) decides and returns a list of these; the loop
(``server.py``) performs them in order and feeds failures back as inputs
(``Allocator.pages_created``, ``Allocator.channel_failed``). A simulator
performs them on fakes. Every effect is plain data.
"""

from __future__ import annotations

import dataclasses

from kvelastic import protocol as p
from kvelastic.kv_events import KVEvent


@dataclasses.dataclass(frozen=True)
class Send:
    """A message to a client over the ROUTER socket (a reply or a command).
    ``channel``: a worker's (engine id, rank, secret): the message goes on
    that worker's page channel instead while it has one (no ZMQ hop)."""

    to: bytes
    msg: p.Msg
    channel: tuple[str, int, bytes] | None = None


@dataclasses.dataclass(frozen=True)
class SendPages:
    """Page descriptors to one worker over its page channel with ``then``
    (the ``MapSlab`` that names them) in the same batch, never one without
    the other (the loop sends ``then`` on the channel, not the socket). The
    daemon could not export them (out of descriptors): ``Allocator.pages_unsent``,
    the slab fails to map, the engine carries on. The worker's channel
    failed: ``Allocator.channel_failed``, the engine is failed."""

    engine_id: str
    rank: int
    device: str
    pages: tuple[int, ...]
    token: bytes                       # only a channel that showed this secret gets them
    then: Send | None = None
    slab: int = -1


@dataclasses.dataclass(frozen=True)
class CreatePages:
    """Create ``count`` fresh pages on ``device``; the loop answers with
    ``Allocator.pages_created(device, ids)`` (fewer ids on failure)."""

    device: str
    count: int


@dataclasses.dataclass(frozen=True)
class ReleasePages:
    """Destroy pages: their memory goes back to the driver or the kernel."""

    device: str
    pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Publish:
    """KV events of one engine's prefix cache (vLLM's format) on the node
    stream; ``tier``: of the node's tier (``kv_events.tier_topic``), on the
    tier stream instead (token ids: only the daemon's user reads it)."""

    topic: bytes
    events: tuple[KVEvent, ...]
    tier: bool = False


@dataclasses.dataclass(frozen=True)
class Rejected:
    """Count a refused message under ``reason`` (the reply is a ``Send``)."""

    reason: p.Reason


@dataclasses.dataclass(frozen=True)
class GrantLatency:
    """A grow was answered after ``seconds`` (``demand``: a demand grow)."""

    device: str
    seconds: float
    demand: bool = False


@dataclasses.dataclass(frozen=True)
class DeleteTierBlocks:
    """Delete the tier's files of ``slots``: the index freed them (invalidated,
    evicted), and a slot is never handed out again (``kvelastic/tier``)."""

    slots: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MoveTierBlocks:
    """Move the bytes of ``slots`` one medium down (host memory to disk): the
    index moved them there to make room above (``TierIndex.take_moves``); each
    comes back as a write done or failed."""

    slots: tuple[int, ...]
    nbytes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DemoteBlock:
    """One block to write to the tier at ``slot`` (reserved): its bytes are
    ``runs`` (device, page id, offset, length) of pages nobody maps, in order."""

    slot: int
    key: bytes
    parent: bytes | None
    cost: float
    runs: tuple[tuple[str, int, int, int], ...]
    label: bytes = b""      # the engine's KV event for it, kept on disk for a restarted daemon to publish
    level: int = 0          # the tier's medium it goes to (0: the top; ``TierIndex.level_of``)


@dataclasses.dataclass(frozen=True)
class DemoteBlocks:
    """Write these blocks of ``namespace`` to the tier, before anything that
    follows releases their pages; the loop answers ``Allocator.tier_written``.
    ``staged``: blocks of a running engine (source B), only copied into the
    loop's staging now (``Allocator.tier_copied``): whether their bytes may
    have been rewritten while read is known later (``WriteStaged``).
    """

    namespace: str
    blocks: tuple[DemoteBlock, ...]
    staged: bool = False


@dataclasses.dataclass(frozen=True)
class WriteStaged:
    """Staged copies (``DemoteBlocks(staged=True)``): write ``write`` to the
    tier (the loop answers ``Allocator.tier_written``), discard ``drop``."""

    write: tuple[int, ...]
    drop: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ReadTierBlock:
    """Answer a ``TierFetch`` (``to``, ``req_id``) with up to ``chunk`` bytes
    of the block at ``slot`` from ``offset`` (a ``TierData``); the loop
    answers ``Allocator.tier_read`` once the block is read whole or failed."""

    to: bytes
    req_id: int
    lease: int
    block: int
    slot: int
    namespace: str
    key: bytes
    offset: int
    chunk: int


Effect = Send | SendPages | CreatePages | ReleasePages | Publish | Rejected | GrantLatency | DeleteTierBlocks | \
    MoveTierBlocks | DemoteBlocks | WriteStaged | ReadTierBlock
