"""The allocator's books: what every part of it reads and keeps.

The records (device pools, engines, departing engines, the channels open to
them, the kept cache of departed ones, slab moves), the clock and sender of
the input being handled, and the effects that input set off, collected for
the loop. The allocator's parts (``registration.py``, ``growth.py``,
``reclaims.py``, ``unmapping.py``, ``handoff.py``, ``invalidation.py``) are
each handed these books and own their own state besides (pending grows,
reclaims, returns); none reaches into another's. Nothing here does I/O.
"""

from __future__ import annotations

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.arbiter import Rules
from kvelastic.daemon.channels import OpenChannels
from kvelastic.daemon.orphans import OrphanCache
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.requests import Timing
from kvelastic.daemon.state import EngineRecord, PagePool
from kvelastic.daemon.tenancy import Credential
from kvelastic.status_report import RestartStatus
from kvelastic.tier.index import TierIndex


class Books:
    def __init__(self, budgets: dict[str, int], page_size: int, backend: str, timing: Timing,
                 events: bool) -> None:
        self.pools = {name: PagePool(pages) for name, pages in budgets.items()}
        self.page_size = page_size
        self.backend = backend
        self.medium = "GPU" if backend == "cuda" else "CPU"
        self.timing = timing
        self.rules = Rules(idle_grace=timing.idle_grace, hold_down=timing.hold_down)
        self.events = events                 # publish KV events of the engines' caches
        self.engines: dict[str, EngineRecord] = {}
        # Engines gone from the books whose slabs still wait for their workers
        # (unmap acks, or their processes to exit when they failed), by their
        # registration's serial: an id registered again meanwhile never
        # overwrites its predecessor's record (no page leaves the books).
        self.departing: dict[int, EngineRecord] = {}
        self.channels = OpenChannels()      # which processes of each engine are alive
        self.orphans = OrphanCache()        # departed engines' cache, kept for their namespace
        self.moves = dict.fromkeys(budgets, 0)     # device -> slabs moved between engines
        self.thrash = dict.fromkeys(budgets, 0)    # device -> moves back within THRASH_WINDOW
        self.tier: TierIndex | None = None  # the node's tier below device memory (None: none configured)
        self.restart: RestartStatus | None = None  # what was taken back at start (None: no keeper)
        self.now = 0.0                      # the time of the input being handled
        self.cred: Credential | None = None  # its sender, as the kernel says (None: in-process)
        self._out: list[fx.Effect] = []
        self._next_req = 1 << 32

    @property
    def takes_evictions(self) -> bool:
        """The tier takes blocks that running engines evict (source B): a tier
        on the host backend, whose pages the daemon reads itself."""
        return self.tier is not None and self.backend == "host"

    # ------------------------------------------------------------ effects
    def emit(self, effect: fx.Effect) -> None:
        self._out.append(effect)

    def command(self, identity: bytes, msg: p.Msg, channel: tuple[str, int, bytes] | None = None) -> int:
        """An unsolicited message to a client, with a request id of the daemon's
        (``channel``: on that worker's page channel, ``fx.Send``)."""
        msg.req_id = self.new_req_id()
        self._out.append(fx.Send(identity, msg, channel))
        return msg.req_id

    def new_req_id(self) -> int:
        self._next_req += 1
        return self._next_req

    def take(self) -> list[fx.Effect]:
        """The effects collected since the last take, for the loop."""
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ lookups
    def engine(self, engine_id: str) -> EngineRecord:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise Rejected(p.Reason.UNKNOWN_ENGINE, f"engine {engine_id!r} is not registered")
        return engine

    def own_engine(self, identity: bytes, engine_id: str) -> EngineRecord:
        """The engine ``engine_id``, if ``identity`` is the connection that registered it."""
        engine = self.engine(engine_id)
        if identity != engine.identity:
            raise Rejected(p.Reason.NOT_OWNER, f"engine {engine_id!r} was registered by another connection")
        return engine

    def departed(self, engine_id: str) -> list[EngineRecord]:
        """Departing records of ``engine_id`` (earlier registrations of it)."""
        return [e for e in self.departing.values() if e.engine_id == engine_id]

    def record_of_worker(self, identity: bytes, engine_id: str, rank: int) -> EngineRecord | None:
        """The registration (live or departing) whose worker ``rank`` registered on ``identity``."""
        for engine in (self.engines.get(engine_id), *self.departed(engine_id)):
            if engine is not None and engine.workers.get(rank) == identity:
                return engine
        return None

    def devices_of(self, engine: EngineRecord) -> set[str]:
        return {engine.worker_devices.get(r, engine.device) for r in range(engine.num_workers)} or {engine.device}

    def operator(self, what: str) -> None:
        """Refuse ``what`` unless the sender holds the operator's credential."""
        cred = self.cred
        if cred is not None and not cred.operator:
            raise Rejected(p.Reason.NOT_OPERATOR, f"{what} needs the operator's credential (root, the daemon's "
                                                  f"user or the operator group); uid {cred.uid} is a tenant")
