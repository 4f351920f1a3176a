"""Every message between engines, workers, the CLI and the daemon, each with
its conversation; this face re-exports them all (``from kvelastic import
protocol as p``).

Transport: ZMQ (ROUTER in the daemon, DEALER in clients) over ``ipc://``,
one msgpack-encoded tagged ``msgspec.Struct`` per frame (``codec.py``).
Every request carries ``req_id``; the daemon answers each with a reply of
the same ``req_id`` (``Ok``, a specific reply, or ``Error``). The daemon
also sends unsolicited commands with request ids of its own (``control.py``).
``Journal`` and ``Heartbeat`` are notifications: they are answered only with
an ``Error``.

- ``base.py``: the version, bounds, timing, ``Reason``, ``Msg``, ``Ok``, ``Error``.
- ``control.py``: engines and workers with the daemon (registration, memory, liveness, maps).
- ``journal.py``: an engine's journal and its ops.
- ``tier.py``: an engine with the node's tier.
- ``operator.py``: the CLI's requests and their answers.
- ``channel.py``: the page channel's and the keeper's sockets, ``Hello``.
- ``codec.py``: the ``Message`` union, ``encode``, ``decode``.

Each imports only ``base.py`` of its siblings (``codec.py`` imports them
all). Below the package: ``names.py`` (the bounds on names),
``status_report.py`` (what ``Status`` answers), ``core/journal.py`` (the op
codes). Beside it: ``kv_events.py``, the KV events the daemon publishes in
vLLM's wire format.
"""

from kvelastic.protocol.base import (
    ACK_TIMEOUT,
    DRAIN_SECONDS,
    GROW_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    HELLO_TIMEOUT,
    HOLD_DOWN,
    IDLE_GRACE,
    MAX_LABEL_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_WORKERS,
    MIN_TOKEN,
    ORPHAN_CACHE_TTL,
    PROTOCOL_VERSION,
    RECLAIM_TIMEOUT,
    REGISTER_TIMEOUT,
    SEND_PAGES_TIMEOUT,
    THRASH_WINDOW,
    Error,
    Key,
    Label,
    Msg,
    Ok,
    Reason,
    Token,
)
from kvelastic.protocol.channel import Hello, Rank, fd_socket_path, keeper_socket_path, read_hello, write_hello
from kvelastic.protocol.codec import Message, decode, encode
from kvelastic.protocol.control import (
    Busy,
    CachedBlock,
    ClearIndex,
    Diverge,
    Drain,
    Failed,
    Granted,
    Grow,
    Heartbeat,
    Mapped,
    MapSlab,
    Reclaim,
    ReclaimDone,
    Registered,
    RegisterEngine,
    RegisterWorker,
    Return,
    SlabCache,
    SlabIds,
    Unmapped,
    UnmapSlab,
    Unregister,
)
from kvelastic.protocol.journal import (
    AddSlab,
    BlockId,
    ClearKeys,
    DemoteBlock,
    Journal,
    JournalFrame,
    JournalOp,
    LabelBlock,
    PromoteBlock,
    RemoveKey,
    RemoveSlab,
    Stats,
    StepBegun,
    StepDone,
    StepNumber,
    StoreKey,
    journal_ops,
)
from kvelastic.protocol.operator import Invalidate, Invalidated, SetLimit, Status, StatusReply
from kvelastic.protocol.tier import (
    MAX_TIER_KEYS,
    TierCopied,
    TierData,
    TierFetch,
    TierLookup,
    TierPinned,
    TierRelease,
)

__all__ = [
    # base
    "ACK_TIMEOUT", "DRAIN_SECONDS", "GROW_TIMEOUT", "HEARTBEAT_INTERVAL", "HEARTBEAT_TIMEOUT", "HELLO_TIMEOUT",
    "HOLD_DOWN",
    "IDLE_GRACE", "MAX_LABEL_BYTES", "MAX_MESSAGE_BYTES", "MAX_WORKERS", "MIN_TOKEN", "ORPHAN_CACHE_TTL",
    "PROTOCOL_VERSION", "RECLAIM_TIMEOUT", "REGISTER_TIMEOUT", "SEND_PAGES_TIMEOUT", "THRASH_WINDOW",
    "Error", "Key", "Label", "Msg", "Ok", "Reason", "Token",
    # channel
    "Hello", "Rank", "fd_socket_path", "keeper_socket_path", "read_hello", "write_hello",
    # codec
    "Message", "decode", "encode",
    # control
    "Busy", "CachedBlock", "ClearIndex", "Diverge", "Drain", "Failed", "Granted", "Grow", "Heartbeat", "MapSlab",
    "Mapped",
    "Reclaim", "ReclaimDone", "RegisterEngine", "Registered", "RegisterWorker", "Return", "SlabCache", "SlabIds",
    "Unmapped", "UnmapSlab", "Unregister",
    # journal
    "AddSlab", "BlockId", "ClearKeys", "DemoteBlock", "Journal", "JournalFrame", "JournalOp", "LabelBlock",
    "PromoteBlock", "RemoveKey", "RemoveSlab", "Stats", "StepBegun", "StepDone", "StepNumber", "StoreKey",
    "journal_ops",
    # operator
    "Invalidate", "Invalidated", "SetLimit", "Status", "StatusReply",
    # tier
    "MAX_TIER_KEYS", "TierCopied", "TierData", "TierFetch", "TierLookup", "TierPinned", "TierRelease",
]
