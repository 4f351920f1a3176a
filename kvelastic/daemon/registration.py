"""Registration of engines and workers: the allocator's part that admits
them (geometry, limits, the engine's secret, adoption after a daemon
restart) and hears that they are alive (heartbeats). It owns the daemon's
hash secret and the registrations' serials; nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable

from kvelastic import protocol as p
from kvelastic.core.stats import COUNTER_NAMES
from kvelastic.daemon.books import Books
from kvelastic.daemon.parts import GrowPass
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.state import EngineRecord, PagePool, Phase, SlabRecord

log = logging.getLogger("kvelastic.daemon")
MAX_BLOCK_TOKENS = 1 << 20   # tokens in one KV block (vLLM's are 16 to a few hundred)


class Registration:
    def __init__(self, books: Books, grows: GrowPass, *, default_device: str, aliases: dict[str, str],
                 max_engines: int, hash_secret: bytes, token_source: Callable[[], bytes]) -> None:
        self.books = books
        self.grows = grows
        self.default_device = default_device
        self.device_aliases = aliases    # other names of a device (a GPU's UUID) -> its name
        self.max_engines = max_engines
        self.hash_secret = hash_secret
        self._token_source = token_source
        self._serial = 0

    def on_register_engine(self, identity: bytes, m: p.RegisterEngine) -> p.Msg:
        books = self.books
        if m.version != p.PROTOCOL_VERSION:
            raise Rejected(p.Reason.VERSION, f"protocol version {m.version}; this daemon speaks {p.PROTOCOL_VERSION}")
        if m.page_size != books.page_size:
            raise Rejected(p.Reason.GEOMETRY,
                           f"page size {m.page_size}; this daemon's pages are {books.page_size} bytes")
        if not m.engine_id or m.pages_per_worker < 1 or m.num_workers < 0 or m.blocks_per_slab < 1 \
                or m.block_bytes < 1 or m.min_bytes < 0 or m.max_bytes < 0 or m.block_tokens < 0 \
                or (m.max_bytes and m.min_bytes > m.max_bytes) or m.pages_per_region < 1 \
                or m.pages_per_worker % m.pages_per_region:
            raise Rejected(p.Reason.GEOMETRY, "engine id, pages_per_worker, pages_per_region, blocks_per_slab, "
                                       "block_bytes must be positive, pages_per_region must divide pages_per_worker, "
                                       "and min_bytes <= max_bytes")
        old = books.engines.get(m.engine_id)
        if old is not None and (not m.token or m.token != old.token):
            raise Rejected(p.Reason.ENGINE_EXISTS, f"engine {m.engine_id!r} is registered by another process "
                                                   f"(pid {old.pid}); a re-registration needs its secret")
        if old is None and m.token and len(m.token) < p.MIN_TOKEN:
            raise Rejected(p.Reason.BAD_TOKEN, f"an engine's secret must be at least {p.MIN_TOKEN} random bytes")
        device = self.device_aliases.get(m.device, m.device) or self.default_device
        if device not in books.pools:
            raise Rejected(p.Reason.UNKNOWN_DEVICE, f"device {device!r}; this daemon has {', '.join(books.pools)}")
        pool = books.pools[device]
        budget = pool.budget_pages * books.page_size
        self._check_geometry(m, budget)
        slab_pages = m.pages_per_worker * max(1, m.num_workers)
        cap = min(budget, m.max_bytes) if m.max_bytes else budget
        if m.min_bytes > budget:
            raise Rejected(p.Reason.LIMIT, f"min_bytes {m.min_bytes} exceeds the device budget {budget}")
        if m.min_bytes and (old is None or m.min_bytes != old.min_bytes):
            books.operator("a guaranteed minimum (KVELASTIC_ENGINE_MIN_MEMORY)")
        if slab_pages * books.page_size > cap:
            raise Rejected(p.Reason.GEOMETRY,
                           f"one slab ({slab_pages * books.page_size} bytes) does not fit in {cap} bytes")
        if old is not None:          # the same engine on a new connection
            old.identity, old.last_seen = identity, books.now
            log.info("engine %s reconnected", m.engine_id)
            return p.Registered(engine_id=m.engine_id, budget_bytes=budget, page_size=books.page_size,
                                max_slabs=old.max_slabs, token=old.token, idle_grace=books.rules.idle_grace,
                                hash_seed=self.hash_seed(old.namespace), orphan_ttl=books.timing.orphan_ttl)
        if len(books.engines) >= self.max_engines:
            raise Rejected(p.Reason.LIMIT, f"{len(books.engines)} engines registered, the most this daemon takes "
                                           f"(KVELASTIC_MAX_ENGINES)")
        max_slabs = cap // (slab_pages * books.page_size)
        held = self._check_adoption(m, pool, slab_pages, max_slabs)
        engine = EngineRecord(
            engine_id=m.engine_id, namespace=m.namespace, pid=m.pid, page_size=books.page_size,
            pages_per_worker=m.pages_per_worker, pages_per_region=m.pages_per_region, num_workers=m.num_workers,
            blocks_per_slab=m.blocks_per_slab, block_bytes=m.block_bytes, block_tokens=m.block_tokens,
            key_group_suffix=m.key_group_suffix, min_bytes=m.min_bytes, private=m.private,
            max_bytes=m.max_bytes, max_slabs=max_slabs, device=device, identity=identity, last_seen=books.now,
            active_at=books.now,
            stats=dict.fromkeys(sorted(COUNTER_NAMES), 0),   # every counter from registration on
            # The engine's own secret (its lifeline showed it already); an old
            # client that sends none gets one, and its lifeline never counts.
            token=m.token or self._token_source(), serial=self._next_serial())
        for slab_id in held:         # re-register after a daemon restart: adopt what it holds
            engine.slabs[slab_id] = SlabRecord(slab_id, [], [], Phase.HELD, set(), adopted_pages=slab_pages)
            pool.adopted += slab_pages
            engine.mirror.hold(slab_id, m.occupancy.get(slab_id, (0, 0, m.blocks_per_slab)))
        books.engines[m.engine_id] = engine
        log.info("engine %s registered: namespace %s, pid %d, %d worker(s), slab %d bytes, "
                 "virtual capacity %d slabs%s", m.engine_id, m.namespace, m.pid, m.num_workers,
                 engine.slab_bytes, max_slabs, f", adopted {len(held)} slab(s)" if held else "")
        return p.Registered(engine_id=m.engine_id, budget_bytes=budget, page_size=books.page_size,
                            max_slabs=max_slabs, token=engine.token, idle_grace=books.rules.idle_grace,
                            hash_seed=self.hash_seed(m.namespace), orphan_ttl=books.timing.orphan_ttl)

    def _next_serial(self) -> int:
        self._serial += 1
        return self._serial

    def _check_geometry(self, m: p.RegisterEngine, budget: int) -> None:
        """Every number an engine declares is bounded by what it could hold,
        so nothing the daemon does for it costs more than its memory does:
        its blocks fit in a slab (``block_bytes``: one block across every
        layer and worker), a slab in the budget."""
        slab_bytes = m.pages_per_worker * max(1, m.num_workers) * self.books.page_size
        if m.num_workers > p.MAX_WORKERS:
            raise Rejected(p.Reason.GEOMETRY, f"{m.num_workers} workers; at most {p.MAX_WORKERS}")
        if m.pages_per_worker * max(1, m.num_workers) > budget // self.books.page_size:
            raise Rejected(p.Reason.GEOMETRY, f"a slab of {m.pages_per_worker} page(s) x {max(1, m.num_workers)} "
                                              f"worker(s) exceeds the device budget of {budget} bytes")
        if m.blocks_per_slab * m.block_bytes > slab_bytes:
            raise Rejected(p.Reason.GEOMETRY, f"{m.blocks_per_slab} blocks of {m.block_bytes} bytes do not fit in a "
                                              f"slab of {slab_bytes} bytes")
        if m.block_tokens > MAX_BLOCK_TOKENS:
            raise Rejected(p.Reason.GEOMETRY, f"{m.block_tokens} tokens per block; at most {MAX_BLOCK_TOKENS}")

    def hash_seed(self, namespace: str) -> str:
        """The namespace's root for block hashes: a keyed hash of its name under
        the daemon's secret. Deterministic (every engine of the namespace, and a
        restarted daemon with the same secret, give the same seed) and
        unpredictable without the secret (KV events and routers see hashes that
        no other tenant or node can compute)."""
        return hmac.new(self.hash_secret, namespace.encode(), hashlib.sha256).hexdigest()

    def _check_adoption(self, m: p.RegisterEngine, pool: PagePool, slab_pages: int, max_slabs: int) -> list[int]:
        """Slabs a re-registering engine says it holds: each once, inside its
        virtual range, and within what the budget has room for."""
        held = m.held
        if len(set(held)) != len(held):
            raise Rejected(p.Reason.BAD_ADOPTION, f"engine {m.engine_id}: a slab appears twice in its held list")
        if held and (min(held) < 0 or max(held) >= max_slabs):
            raise Rejected(p.Reason.BAD_ADOPTION, f"engine {m.engine_id}: held slab ids must lie in 0..{max_slabs - 1}")
        if len(held) * slab_pages > pool.creatable():
            raise Rejected(p.Reason.BAD_ADOPTION, f"engine {m.engine_id}: {len(held)} held slab(s) need "
                                           f"{len(held) * slab_pages} pages, the budget has room for "
                                           f"{pool.creatable()}")
        for slab_id, occ in m.occupancy.items():
            if slab_id not in held:
                continue
            if len(occ) != 3 or min(occ) < 0 or sum(occ) != m.blocks_per_slab:
                raise Rejected(p.Reason.BAD_ADOPTION, f"slab {slab_id}: occupancy {occ} does not add up")
        return sorted(held)

    def on_register_worker(self, identity: bytes, m: p.RegisterWorker) -> p.Msg:
        books = self.books
        if m.version != p.PROTOCOL_VERSION:
            raise Rejected(p.Reason.VERSION, f"protocol version {m.version}; this daemon speaks {p.PROTOCOL_VERSION}")
        engine = books.engine(m.engine_id)
        if m.token != engine.token:      # first: without the secret, nothing else about the engine is told
            raise Rejected(p.Reason.BAD_TOKEN, f"worker {m.rank} of {m.engine_id}: not its engine's secret")
        if not 0 <= m.rank < engine.num_workers:
            raise Rejected(p.Reason.BAD_RANK,
                           f"rank {m.rank} of engine {m.engine_id} with {engine.num_workers} workers")
        device = self.device_aliases.get(m.device, m.device) or engine.device
        if device not in books.pools:
            raise Rejected(p.Reason.UNKNOWN_DEVICE, f"device {device!r}; this daemon has {', '.join(books.pools)}")
        if not books.channels.alive(engine, m.rank):
            raise Rejected(p.Reason.NO_CHANNEL, f"worker {m.rank} of {m.engine_id} has not opened its page channel "
                                                f"with its engine's secret")
        engine.workers[m.rank] = identity
        engine.worker_devices[m.rank] = device
        log.info("engine %s: worker %d registered (pid %d)", m.engine_id, m.rank, m.pid)
        self.grows.progress()
        budget = books.pools[device].budget_pages * books.page_size
        return p.Registered(engine_id=engine.engine_id, budget_bytes=budget, page_size=books.page_size,
                            max_slabs=engine.max_slabs, pages_per_worker=engine.pages_per_worker,
                            ack_timeout=books.timing.ack_timeout)

    def on_heartbeat(self, identity: bytes, m: p.Heartbeat) -> None:
        engine = self.books.own_engine(identity, m.engine_id)
        engine.last_seen = self.books.now
        if engine.unresponsive:
            engine.unresponsive = False
            log.info("engine %s: heartbeats again", engine.engine_id)

    def on_set_limit(self, identity: bytes, m: p.SetLimit) -> p.Msg:
        books = self.books
        books.operator("setting an engine's limits")
        engine = books.engine(m.engine_id)
        if m.min_bytes < 0 or m.max_bytes < 0 or (m.max_bytes and m.min_bytes > m.max_bytes):
            raise Rejected(p.Reason.LIMIT, f"need 0 <= min <= max, got min {m.min_bytes} max {m.max_bytes}")
        if m.min_bytes > books.pools[engine.device].budget_pages * books.page_size:
            raise Rejected(p.Reason.LIMIT, f"min {m.min_bytes} exceeds the device budget")
        engine.min_bytes, engine.max_bytes = m.min_bytes, m.max_bytes
        log.info("engine %s: limits set to min %d max %d bytes", engine.engine_id, m.min_bytes, m.max_bytes)
        return p.Ok()
