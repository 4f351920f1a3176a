"""What every conversation shares: the version, the bounds on what a client
may send, the timing both sides rely on, why the daemon refuses a message
(``Reason``), and the request's rule: every ``Msg`` carries ``req_id``, and
the daemon answers each request with a reply of the same ``req_id`` (``Ok``,
a specific reply, or ``Error``).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

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
DRAIN_SECONDS = 5.0          # an engine asked to yield slabs holds them back for this long, then uses them again
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
# An engine's registration secret: given to it over its own connection, and
# shown by its workers (RegisterWorker, the page channel's Hello) and by its
# own re-registrations. Nobody else can act for that engine without it.
Token = Annotated[bytes, msgspec.Meta(max_length=64)]
MIN_TOKEN = 16               # bytes of a new engine's secret (it chooses it: ``EngineClient``)
MAX_WORKERS = 1024           # workers (ranks) of one engine


# Every message: a map tagged with its class name (``{"type": "Grow", ...}``),
# so a field with a default can be added without breaking older peers.
class Msg(msgspec.Struct, tag=True, kw_only=True, array_like=False):
    req_id: int = 0


# The daemon's answers to any request.
class Ok(Msg):
    pass


class Error(Msg):
    reason: str                  # machine-readable, also the metric label
    message: str
