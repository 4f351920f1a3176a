"""The CLI's requests (``kvelastic status``, ``top``, ``limit``,
``invalidate``: ``ctl.py``) and the daemon's answers to them; ``SetLimit``
is answered with ``Ok``.
"""

from __future__ import annotations

from kvelastic.names import ShownName
from kvelastic.protocol.base import Msg
from kvelastic.status_report import StatusReport


# ----------------------------------------------------- operator (CLI) requests
class Status(Msg):
    pass


class SetLimit(Msg):
    engine_id: ShownName         # as ``status`` shows it
    min_bytes: int
    max_bytes: int


class Invalidate(Msg):
    target: ShownName            # a namespace or an engine id (a tenant's: its own, with or without @uid<N>)


# ---------------------------------------------------------- daemon -> the CLI
class Invalidated(Msg):
    """The answer to ``Invalidate``: engines told to clear their index, and
    blocks of kept cache (departed engines') dropped, and blocks of the
    node's tier dropped."""
    engines: int
    kept_blocks: int
    tier_blocks: int = 0


class StatusReply(Msg):
    status: StatusReport
