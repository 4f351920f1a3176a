"""The tier's medium chosen in one place: the daemon opens its store here
and holds it as a ``TierStore`` (``store.py``). The disk (``disk.py``: a
file a block in a folder only the daemon may write, rebuilt after a
restart), host memory (``host.py``: the daemon's own, gone with it), or
host memory over the disk (``layered.py``)."""

from __future__ import annotations

import os

from kvelastic.tier.disk import DiskStore, UntrustedTierDir
from kvelastic.tier.host import HostStore
from kvelastic.tier.layered import LayeredStore
from kvelastic.tier.store import TierStore

MEDIA = ("disk", "host", "host+disk")

# Raised when the place the tier was told to use is not the daemon's alone
# (its ``why`` says so, for the operator).
UntrustedTier = UntrustedTierDir


def open_store(medium: str, directory: str | os.PathLike[str] = "", *, key: bytes | None = None) -> TierStore:
    """The tier's store: ``"disk"`` at ``directory`` (a file a block), whose
    reads ``key`` (the node's hash secret) proves this daemon's; ``"host"``:
    host memory (no directory, no key: nobody else can write it);
    ``"host+disk"``: both, host memory above. Raises ``UntrustedTier`` or
    ``OSError``."""
    if medium not in MEDIA:
        raise ValueError(f"unknown tier medium {medium!r} (one of {MEDIA})")
    if medium == "host":
        return HostStore()
    disk = DiskStore(directory, key=key)
    return LayeredStore(HostStore(), disk) if medium == "host+disk" else disk
