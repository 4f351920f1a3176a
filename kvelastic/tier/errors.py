"""Typed errors of the tier (the store below device memory).

As in ``kvelastic/errors.py``: each carries a ``reason`` (a metric label, and
the reason a failure is counted under in ``TierStats.failures``), and raising
one promises that the failed operation changed nothing it owns: the index's
books are as they were, and a failed write leaves no file behind.
"""

from kvelastic.errors import KvelasticError


class TierError(KvelasticError):
    reason = "tier"


# --- the index: a caller named a slot wrongly (a bug in the caller, not bad data)
class UnknownTierSlot(TierError):
    """No entry holds this slot (never reserved, or already freed)."""

    reason = "unknown_slot"


class TierSlotState(TierError):
    """The slot's entry is not in the state the call needs (commit of a
    committed entry, unpin of an unpinned one, lookup-pinning a pending one)."""

    reason = "slot_state"


# --- the bytes: what a store raises; each is a failure counted by its reason
class TierReadError(TierError):
    """A block's bytes could not be served. Never carries partial bytes."""

    reason = "io"


class TornBlock(TierReadError):
    """The file is shorter or longer than its header says, or its header is
    unreadable: a write that did not finish (or a file cut short since)."""

    reason = "torn"


class ChecksumMismatch(TierReadError):
    """The header or the payload does not match its checksum: flipped bits."""

    reason = "checksum"


class IdentityMismatch(TierReadError):
    """The block's header names another namespace or key than the caller
    expected: the slot was confused. Serving it would mix KV, so it is refused."""

    reason = "identity"


class TierWriteError(TierError):
    """A block could not be written (an I/O error); no file was left."""

    reason = "io"


class TierDiskFull(TierWriteError):
    """The file system is full (ENOSPC, or EDQUOT: a quota); no file was left."""

    reason = "disk_full"


class TierMemoryFull(TierWriteError):
    """Host memory for the tier ran out (ENOMEM, ENOSPC: the kernel or the
    daemon's cgroup had no page to give); nothing of the block was kept."""

    reason = "memory_full"
