"""Typed errors shared by every layer.

Each error carries a short machine-readable ``reason`` (used as a metric label
and in protocol error replies) and a message written for the operator. Raising
one of these promises that the failed operation changed nothing.
"""


class KvelasticError(Exception):
    reason = "error"


class ConfigError(KvelasticError, ValueError):
    reason = "config"


# --- core pool -------------------------------------------------------------
class PoolError(KvelasticError):
    reason = "pool"


class OutOfBlocks(PoolError):
    reason = "out_of_blocks"


class UnknownBlock(PoolError):
    reason = "unknown_block"


class BlockNotLive(PoolError):
    """free/cache of a block whose refcount is already 0."""

    reason = "block_not_live"


class BlockNotCached(PoolError):
    """touch of a block that is neither live nor cached (a free block)."""

    reason = "block_not_cached"


class UnknownSlab(PoolError):
    reason = "unknown_slab"


class SlabAlreadyHeld(PoolError):
    reason = "slab_already_held"


class SlabBusy(PoolError):
    """A slab with live blocks cannot be returned or reclaimed."""

    reason = "slab_busy"


class PoolBusy(PoolError):
    reason = "pool_busy"


class InvariantViolation(KvelasticError):
    """The books broke one of their invariants (a bug, never bad input): what
    the self-checks raise, which the tests and simulators report."""

    reason = "invariant"


def require(condition: bool, what: str) -> None:
    """Check an invariant (kept under ``python -O``, unlike ``assert``)."""
    if not condition:
        raise InvariantViolation(what)


class IndexerError(KvelasticError):
    """The router's KV indexer could not be reached or refused a request."""
