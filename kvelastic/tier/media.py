"""The tier's medium chosen in one place: the daemon opens its store here
and holds it as a ``TierStore`` (``store.py``), so a second medium (host
memory) is one more branch here and a module beside ``disk.py``."""

from __future__ import annotations

import os

from kvelastic.tier.disk import DiskStore, UntrustedTierDir
from kvelastic.tier.store import TierStore

# Raised when the place the tier was told to use is not the daemon's alone
# (its ``why`` says so, for the operator).
UntrustedTier = UntrustedTierDir


def open_store(directory: str | os.PathLike[str], *, key: bytes | None) -> TierStore:
    """The tier's store at ``directory`` (the disk: a file a block), whose
    reads ``key`` (the node's hash secret) proves this daemon's. Raises
    ``UntrustedTier`` or ``OSError``."""
    return DiskStore(directory, key=key)
