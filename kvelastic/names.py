"""Bounds on the names a client gives and the daemon shows: engine ids and
namespaces. Below the protocol and the status report, which both carry them."""

from __future__ import annotations

from typing import Annotated

import msgspec

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]       # engine ids, namespaces
# A name as the daemon shows it: a tenant's carries ``@uid<N>`` (``daemon/tenancy.py``).
ShownName = Annotated[str, msgspec.Meta(min_length=1, max_length=160)]
