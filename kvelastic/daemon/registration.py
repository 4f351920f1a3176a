"""Registration of engines and workers: the allocator's part that admits
them (geometry, limits, the engine's secret, adoption after a daemon
restart) and hears that they are alive (heartbeats). It owns the daemon's
hash secret, the registrations' serials and, after a restart, the lent
records its predecessor saved (``saved.py``), held for their engines'
claims for ``LENT_GRACE``; nothing here does I/O.

A re-registering engine's claimed slab is adopted *with* its pages (so that
its cache can be kept when it leaves, like any engine's) only when a held
record matches it exactly: same engine id, namespace, uid and secret, same
slab id, the engine's device and slab size. Otherwise it is adopted without
pages, as ever (``adopted_pages``), and counted by why. Once an engine id
registers, every record of it left unclaimed is let go at once: no later
claim can be that registration's.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Sequence

import msgspec

from kvelastic import protocol as p
from kvelastic.core.stats import COUNTER_NAMES
from kvelastic.daemon import effects as fx
from kvelastic.daemon.books import Books
from kvelastic.daemon.parts import GrowPass
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.saved import SavedLent, token_digest
from kvelastic.daemon.state import EngineRecord, PagePool, Phase, SlabRecord

log = logging.getLogger("kvelastic.daemon")
MAX_BLOCK_TOKENS = 1 << 20   # tokens in one KV block (vLLM's are 16 to a few hundred)
# How long a new daemon holds its predecessor's lent records (and their
# pages, in the keeper) for their engines' claims: the window it already
# gives a reconnecting engine's processes to register (a page channel whose
# engine has not registered by then is closed), five times the engines'
# longest reconnect backoff (2 s). A claim after it adopts without pages.
LENT_GRACE = p.REGISTER_TIMEOUT


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
        # A predecessor's lent records held for claims: engine id -> slab id -> record.
        self.lent: dict[str, dict[int, SavedLent]] = {}
        self.lent_until = 0.0
        self.lent_gone: dict[tuple[str, int], str] = {}   # (engine, slab) of a record not held -> why
        # Claimed records awaiting the engine's workers: engine id -> (its
        # registration's serial, slab id -> record, slab id -> ranks that said they map it).
        self.awaiting: dict[str, tuple[int, dict[int, SavedLent], dict[int, set[int]]]] = {}
        self.lent_version = 0                              # moves whenever ``lent`` does

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
            if not old.keys_current:     # a ClearIndex it may never have heard (the old connection's)
                books.command(identity, p.ClearIndex(scope=old.clears_sent))
            return p.Registered(engine_id=m.engine_id, budget_bytes=budget, page_size=books.page_size,
                                max_slabs=old.max_slabs, token=old.token, idle_grace=books.rules.idle_grace,
                                hash_seed=self.hash_seed(old.namespace), orphan_ttl=books.timing.orphan_ttl,
                                tier=books.takes_evictions, scope=old.clears_heard)
        if len(books.engines) >= self.max_engines:
            raise Rejected(p.Reason.LIMIT, f"{len(books.engines)} engines registered, the most this daemon takes "
                                           f"(KVELASTIC_MAX_ENGINES)")
        max_slabs = cap // (slab_pages * books.page_size)
        held = self._check_adoption(m, pool, slab_pages, max_slabs)
        uid = books.cred.uid if books.cred is not None else -1
        claims = self._match_claims(m, held, device, slab_pages, uid)
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
            token=m.token or self._token_source(), serial=self._next_serial(), uid=uid)
        for slab_id in held:         # re-register after a daemon restart: adopt what it holds
            # Without pages at first, a matched claim too: its pages become the
            # daemon's once every worker re-registered with the slab mapped
            # (``_confirm``); unmapped before that, no worker could still map them.
            engine.slabs[slab_id] = SlabRecord(slab_id, [], [], Phase.HELD, set(), adopted_pages=slab_pages)
            pool.engine_held(slab_pages)
            engine.mirror.hold(slab_id, m.occupancy.get(slab_id, (0, 0, m.blocks_per_slab)))
        self._settle_claims(engine, claims)
        books.engines[m.engine_id] = engine
        log.info("engine %s registered: namespace %s, pid %d, %d worker(s), slab %d bytes, "
                 "virtual capacity %d slabs%s", m.engine_id, m.namespace, m.pid, m.num_workers,
                 engine.slab_bytes, max_slabs, f", adopted {len(held)} slab(s)" if held else "")
        if engine.num_workers == 0:
            self._confirm(engine)
        return p.Registered(engine_id=m.engine_id, budget_bytes=budget, page_size=books.page_size,
                            max_slabs=max_slabs, token=engine.token, idle_grace=books.rules.idle_grace,
                            hash_seed=self.hash_seed(m.namespace), orphan_ttl=books.timing.orphan_ttl,
                            tier=books.takes_evictions)

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
        # Its own held lent records' pages are room for it (used or let go as it registers).
        device = next(name for name, each in self.books.pools.items() if each is pool)
        room = pool.creatable() + sum(rec.page_devices.count(device) for rec in self.lent.get(m.engine_id, {}).values())
        if len(held) * slab_pages > room:
            raise Rejected(p.Reason.BAD_ADOPTION, f"engine {m.engine_id}: {len(held)} held slab(s) need "
                                           f"{len(held) * slab_pages} pages, the budget has room for {room}")
        for slab_id, occ in m.occupancy.items():
            if slab_id not in held:
                continue
            if len(occ) != 3 or min(occ) < 0 or sum(occ) != m.blocks_per_slab:
                raise Rejected(p.Reason.BAD_ADOPTION, f"slab {slab_id}: occupancy {occ} does not add up")
        return sorted(held)

    # ----------------------------------------- lent records (warm restarts)
    def hold_lent(self, records: list[SavedLent], dropped: dict[tuple[str, int], str], until: float) -> None:
        """A predecessor's lent records to hold for claims until ``until``
        (``saved.adopt`` checked them; the loop holds their pages now, and
        the budget counts them: ``PagePool.held_lent``); ``dropped``: the
        (engine, slab) of records not held, and why."""
        for rec in records:
            self.lent.setdefault(rec.engine_id, {})[rec.slab_id] = rec
            for device in rec.page_devices:
                self.books.pools[device].hold_lent(1)
        self.lent_gone.update(dropped)
        self.lent_until = until
        self.lent_version += 1

    def held_records(self) -> list[SavedLent]:
        """Every record whose pages the daemon holds: unclaimed, or claimed and awaiting its workers."""
        out = [rec for mine in self.lent.values() for rec in mine.values()]
        return out + [rec for _, mine, _ in self.awaiting.values() for rec in mine.values()]

    def records_to_save(self) -> list[SavedLent]:
        """The held records a state file names: the unclaimed ones, and those
        awaiting their workers whose slab is still held without pages by the
        registration that claimed it (one unmapped since names nothing)."""
        out = [rec for mine in self.lent.values() for rec in mine.values()]
        for engine_id, (serial, mine, _) in self.awaiting.items():
            engine = self.books.engines.get(engine_id)
            if engine is None or engine.serial != serial:
                continue
            for slab_id, rec in mine.items():
                slab = engine.slabs.get(slab_id)
                if slab is not None and slab.phase is Phase.HELD and not slab.pages:
                    out.append(rec)
        return out

    def lent_pages(self) -> dict[str, list[int]]:
        """Device -> the pages of ``held_records`` (the daemon's, in no slab, lent to no one new)."""
        out: dict[str, list[int]] = {}
        for rec in self.held_records():
            for page, device in zip(rec.pages, rec.page_devices):
                out.setdefault(device, []).append(page)
        return out

    def pending_pages(self) -> dict[str, int]:
        """Device -> pages of the unclaimed records (``PagePool.held_lent``)."""
        out: dict[str, int] = {}
        for mine in self.lent.values():
            for rec in mine.values():
                for device in rec.page_devices:
                    out[device] = out.get(device, 0) + 1
        return out

    def awaiting_pages(self) -> int:
        """Pages of claimed records awaiting their workers (the budget counts their slabs as adopted)."""
        return sum(len(rec.pages) for _, mine, _ in self.awaiting.values() for rec in mine.values())

    def expire_lent(self) -> None:
        """Past the grace period: the records no engine claimed, or whose
        workers did not all confirm them, are let go (their pages released)."""
        if (not self.lent and not self.awaiting) or self.books.now < self.lent_until:
            return
        records = [rec for mine in self.lent.values() for rec in mine.values()]
        self.lent.clear()
        self.lent_gone.update(((r.engine_id, r.slab_id), "late") for r in records)
        for engine_id in list(self.awaiting):
            self._unconfirmed(engine_id)
        self.lent_version += 1
        self._let_go(records, "no engine claimed it within the grace period", pending=True)

    def _match_claims(self, m: p.RegisterEngine, held: list[int], device: str, slab_pages: int,
                      uid: int) -> dict[int, SavedLent | str]:
        """Slab id -> the held record that matches its claim exactly, or why none."""
        mine = self.lent.get(m.engine_id, {})
        if not held or (self.books.restart is None and not mine):
            return {}                  # no keeper at start: nothing saved, nothing to count
        digest = token_digest(m.token)
        out: dict[int, SavedLent | str] = {}
        for slab_id in held:
            rec = mine.get(slab_id)
            if rec is None:
                out[slab_id] = self.lent_gone.get((m.engine_id, slab_id), "no_record")
            elif rec.namespace != m.namespace or rec.uid != uid or not m.token or rec.token != digest \
                    or rec.device != device or len(rec.pages) != slab_pages:
                out[slab_id] = "mismatch"
            else:
                out[slab_id] = rec
        return out

    def _settle_claims(self, engine: EngineRecord, claims: dict[int, SavedLent | str]) -> None:
        """``engine`` registered (its claimed slabs adopted without pages): its
        matched records await its workers' confirmation, the rest of its
        records are let go, the claims that matched none counted."""
        engine_id = engine.engine_id
        if engine_id in self.awaiting:             # an earlier registration of that id never confirmed
            self._unconfirmed(engine_id)
        mine = self.lent.pop(engine_id, None)
        if mine is not None:
            self.lent_version += 1
        matched = {slab_id: rec for slab_id, rec in claims.items() if isinstance(rec, SavedLent)}
        for rec in matched.values():
            for device in rec.page_devices:
                self.books.pools[device].lent_settled(1)   # counted as the adopted slab's pages now
        if matched:
            self.awaiting[engine_id] = (engine.serial, matched, {slab_id: set() for slab_id in matched})
        unused = [rec for slab_id, rec in (mine or {}).items() if claims.get(slab_id) is not rec]
        self._count(unmatched=[c for c in claims.values() if isinstance(c, str)])
        for rec in unused:
            self.lent_gone[(rec.engine_id, rec.slab_id)] = "mismatch" if rec.slab_id in claims else "no_record"
        self._let_go(unused, f"engine {engine_id} registered without a claim that matches it", pending=True)

    def _worker_confirms(self, engine: EngineRecord, rank: int, mapped: list[int]) -> None:
        """A worker of ``engine`` registered saying it maps ``mapped``."""
        entry = self.awaiting.get(engine.engine_id)
        if entry is None or entry[0] != engine.serial:
            return
        for slab_id, ranks in entry[2].items():
            if slab_id in mapped:
                ranks.add(rank)
        if all(rank in engine.workers for rank in range(engine.num_workers)):
            self._confirm(engine)

    def _confirm(self, engine: EngineRecord) -> None:
        """Every worker of ``engine`` registered: each awaiting slab still held
        that every rank maps takes its record's pages (the daemon's again, so
        its cache is kept when the engine leaves); the others' are let go."""
        entry = self.awaiting.pop(engine.engine_id, None)
        if entry is None:
            return
        self.lent_version += 1
        _, matched, ranks = entry
        books, adopted, dropped = self.books, 0, []
        for slab_id, rec in matched.items():
            slab = engine.slabs.get(slab_id)
            need: dict[str, int] = {}
            for device in rec.page_devices:
                need[device] = need.get(device, 0) + 1
            room = {d: books.pools[d].creatable() + (slab.adopted_pages if slab and d == engine.device else 0)
                    for d in need}
            if slab is None or slab.phase is not Phase.HELD or slab.pages \
                    or ranks[slab_id] != set(range(engine.num_workers)) or any(need[d] > room[d] for d in need):
                dropped.append(rec)
                continue
            books.pools[engine.device].engine_let_go(slab.adopted_pages)
            slab.adopted_pages = 0
            slab.pages, slab.page_devices = list(rec.pages), list(rec.page_devices)
            for device, n in need.items():
                books.pools[device].took_over(n)
            engine.lent_changes += 1
            adopted += 1
        if adopted:
            log.info("engine %s: %d adopted slab(s) confirmed by its workers: their pages are the daemon's again",
                     engine.engine_id, adopted)
        self._count(adopted=adopted, unmatched=["unconfirmed"] * len(dropped))
        self._let_go(dropped, f"engine {engine.engine_id}'s workers did not confirm them")

    def _unconfirmed(self, engine_id: str) -> None:
        _, matched, _ = self.awaiting.pop(engine_id)
        self.lent_version += 1
        self._count(unmatched=["unconfirmed"] * len(matched))
        self._let_go(list(matched.values()), f"engine {engine_id}'s workers did not confirm them in time")

    def departed(self, engine: EngineRecord) -> None:
        """``engine`` left the books: its claims awaiting confirmation never will be."""
        entry = self.awaiting.get(engine.engine_id)
        if entry is not None and entry[0] == engine.serial:
            self._unconfirmed(engine.engine_id)

    def _count(self, adopted: int = 0, unmatched: Sequence[str] = ()) -> None:
        """Copy on write: the status snapshots the loop published keep what they said."""
        restart = self.books.restart
        if restart is None or (not adopted and not unmatched):
            return
        counts = dict(restart.lent_unmatched)
        for why in unmatched:
            counts[why] = counts.get(why, 0) + 1
        self.books.restart = msgspec.structs.replace(restart, lent_adopted=restart.lent_adopted + adopted,
                                                     lent_unmatched=counts)

    def _let_go(self, records: list[SavedLent], why: str, pending: bool = False) -> None:
        """Release the pages of ``records`` (``pending``: still counted in ``held_lent``)."""
        if not records:
            return
        by_device: dict[str, list[int]] = {}
        for rec in records:
            for page, device in zip(rec.pages, rec.page_devices):
                by_device.setdefault(device, []).append(page)
        for device, pages in by_device.items():
            if pending:
                self.books.pools[device].lent_settled(len(pages))
            self.books.emit(fx.ReleasePages(device, tuple(pages)))
        restart = self.books.restart
        if restart is not None:
            self.books.restart = msgspec.structs.replace(restart, lent_let_go=restart.lent_let_go + len(records))
        log.info("%d lent slab record(s) of the last daemon let go (%s), %d page(s) released",
                 len(records), why, sum(len(pages) for pages in by_device.values()))

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
        if self.awaiting:
            self._worker_confirms(engine, m.rank, m.mapped)
        self.grows.progress()
        budget = books.pools[device].budget_pages * books.page_size
        return p.Registered(engine_id=engine.engine_id, budget_bytes=budget, page_size=books.page_size,
                            max_slabs=engine.max_slabs, pages_per_worker=engine.pages_per_worker,
                            ack_timeout=books.timing.ack_timeout)

    def on_heartbeat(self, identity: bytes, m: p.Heartbeat) -> None:
        engine = self.books.own_engine(identity, m.engine_id)
        engine.last_seen = self.books.now
        if engine.silent(False):
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
