"""The daemon: one loop over typed messages.

One thread owns everything: a ZMQ ROUTER for requests, the AF_UNIX peers
(``peers.py``: page channels, and lifelines whose closing says a peer died),
the device pools (``devices.py``) and the KV event stream (``events.py``);
``state.py`` keeps the books. This module is the loop and the flows. A handler
validates its whole message before it changes anything; a bad message gets an
``Error`` reply, a log line with the engine id and a count in
``kvelastic_rejected_messages_total``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.core.journal import ADD_SLAB, CLEAR, REMOVE, REMOVE_SLAB, STORE, JournalBatch
from kvelastic.daemon.devices import Device
from kvelastic.daemon.events import KVEventPublisher, journal_events
from kvelastic.daemon.peers import PeerTable
from kvelastic.daemon.state import EngineRecord, Phase, SlabRecord, owner_tag, pick_victims
from kvelastic.metrics import DaemonMetrics

log = logging.getLogger("kvelastic.daemon")

HEARTBEAT_TIMEOUT = 1.5      # seconds without a heartbeat before an engine is declared dead
RECLAIM_TIMEOUT = 1.0        # an owner that does not answer a reclaim in time refuses it
MAX_GROW = 4096              # slabs in one grow request
_JOURNAL_ARITY = {ADD_SLAB: 2, REMOVE_SLAB: 2, STORE: 3, REMOVE: 3, CLEAR: 1}


class Rejected(Exception):
    """A client error: reply ``Error(reason, message)``; nothing was changed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class GrowRequest:
    engine_id: str
    identity: bytes
    req_id: int
    wanted: int
    started: float
    demand: bool = False
    slabs: list[int] = dataclasses.field(default_factory=list)     # mapped and granted
    mapping: set[int] = dataclasses.field(default_factory=set)     # waiting for worker acks
    reclaims_out: int = 0
    reclaim_rounds: int = 0


class Daemon:
    def __init__(self, devices: list[Device], socket_path: str, *,
                 clock: Callable[[], float] = time.monotonic,
                 kv_events: tuple[str, str, int] | None = None) -> None:
        self.devices = {d.name: d for d in devices}
        self.default_device = devices[0].name
        self.page_size = devices[0].page_size
        self.clock = clock
        self.engines: dict[str, EngineRecord] = {}
        self.departing: dict[str, EngineRecord] = {}     # dead engines whose slabs are unmapping
        self.grows: list[GrowRequest] = []
        self.reclaims: dict[int, tuple[str, list[int], GrowRequest | None, float]] = {}
        self._next_req = 1 << 32
        self._progressing = self._progress_again = False
        self._return_waits: dict[tuple[bytes, int], int] = {}  # (client, Return req_id) -> slabs unmapping
        self.metrics = DaemonMetrics(self.status, list(self.devices))
        self.socket_path = socket_path
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, 16 * p.MAX_MESSAGE_BYTES)
        self.router.bind(f"ipc://{socket_path}")
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.peers = PeerTable(p.fd_socket_path(socket_path), self.poller,
                               lambda: self.metrics.rejected.labels("bad_hello").inc())
        self.events = KVEventPublisher(self.ctx, *kv_events) if kv_events else None
        if self.events is not None:
            self.poller.register(self.events.replay, zmq.POLLIN)
        self._medium = "GPU" if devices[0].backend.name == "cuda" else "CPU"
        self._handlers = {
            p.RegisterEngine: self._on_register_engine, p.RegisterWorker: self._on_register_worker,
            p.Grow: self._on_grow, p.Return: self._on_return, p.Journal: self._on_journal,
            p.Heartbeat: self._on_heartbeat, p.Unregister: self._on_unregister,
            p.ReclaimDone: self._on_reclaim_done, p.Mapped: self._on_mapped,
            p.Unmapped: self._on_unmapped, p.Status: self._on_status, p.SetLimit: self._on_set_limit,
            p.Invalidate: self._on_invalidate,
        }

    # ------------------------------------------------------------------ loop
    def serve(self, should_stop: Callable[[], bool]) -> None:
        last_tick = 0.0
        while not should_stop():
            events = dict(self.poller.poll(50))
            if self.router in events:
                for _ in range(256):
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(frames)
            if self.peers.listener.fileno() in events:
                self.peers.accept()
            for fd in [fd for fd in events if fd in self.peers.by_fd]:
                self._on_peer_closed(fd)
            if self.events is not None and self.events.replay in events:
                self.events.serve_replay()
            now = self.clock()
            if now - last_tick >= 0.1:
                last_tick = now
                self._tick(now)

    def close(self) -> None:
        for engine in list(self.engines.values()):
            self._drop_engine(engine, "daemon stopping")
        self.peers.close()
        self.router.close(0)
        if self.events is not None:
            self.events.close()
        for path in (self.socket_path, p.fd_socket_path(self.socket_path)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for device in self.devices.values():
            device.release_all()

    def _dispatch(self, frames: list[bytes]) -> None:
        identity = frames[0]
        msg = None
        try:
            if len(frames) != 2:
                raise Rejected("malformed", f"expected one frame per message, got {len(frames) - 1}")
            if len(frames[1]) > p.MAX_MESSAGE_BYTES:
                raise Rejected("oversize", f"message of {len(frames[1])} bytes exceeds {p.MAX_MESSAGE_BYTES}")
            try:
                msg = p.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise Rejected("malformed", f"cannot decode message: {exc}") from None
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise Rejected("unexpected", f"{type(msg).__name__} is not a request")
            try:
                reply = handler(identity, msg)
            except Rejected:
                raise
            except Exception as exc:  # a bug must not take the node's memory manager down
                log.exception("internal error handling %s", type(msg).__name__)
                raise Rejected("internal", f"internal error: {type(exc).__name__}: {exc}") from None
        except Rejected as exc:
            engine = getattr(msg, "engine_id", "-")
            log.warning("rejected %s from engine %s: %s (%s)", type(msg).__name__ if msg else "frame",
                        engine, exc, exc.reason)
            self.metrics.rejected.labels(exc.reason).inc()
            reply = p.Error(reason=exc.reason, message=str(exc))
        if reply is not None:
            reply.req_id = msg.req_id if msg is not None else 0
            self._send(identity, reply)

    def _send(self, identity: bytes, msg: p.Msg) -> None:
        try:
            self.router.send_multipart([identity, p.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send %s: %s", type(msg).__name__, exc)

    def _command(self, identity: bytes, msg: p.Msg) -> int:
        """An unsolicited message to a client, with a request id of the daemon's."""
        self._next_req += 1
        msg.req_id = self._next_req
        self._send(identity, msg)
        return self._next_req

    # ---------------------------------------------------------- engines
    def _engine(self, engine_id: str) -> EngineRecord:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise Rejected("unknown_engine", f"engine {engine_id!r} is not registered")
        return engine

    def _on_register_engine(self, identity: bytes, m: p.RegisterEngine) -> p.Msg:
        if m.version != p.PROTOCOL_VERSION:
            raise Rejected("version", f"protocol version {m.version}; this daemon speaks {p.PROTOCOL_VERSION}")
        if m.page_size != self.page_size:
            raise Rejected("geometry", f"page size {m.page_size}; this daemon's pages are {self.page_size} bytes")
        if not m.engine_id or m.pages_per_worker < 1 or m.num_workers < 0 or m.blocks_per_slab < 1 \
                or m.block_bytes < 1 or m.min_bytes < 0 or m.max_bytes < 0 \
                or (m.max_bytes and m.min_bytes > m.max_bytes):
            raise Rejected("geometry", "engine id, pages_per_worker, blocks_per_slab, block_bytes must be "
                                       "positive and min_bytes <= max_bytes")
        old = self.engines.get(m.engine_id)
        if old is not None and old.pid != m.pid:
            raise Rejected("engine_exists", f"engine {m.engine_id!r} is registered by pid {old.pid}")
        device = m.device or self.default_device
        if device not in self.devices:
            raise Rejected("unknown_device", f"device {device!r}; this daemon has {', '.join(self.devices)}")
        slab_bytes = m.pages_per_worker * max(1, m.num_workers) * self.page_size
        budget = self.devices[device].budget_bytes
        cap = min(budget, m.max_bytes) if m.max_bytes else budget
        if m.min_bytes > budget:
            raise Rejected("limit", f"min_bytes {m.min_bytes} exceeds the device budget {budget}")
        if slab_bytes > cap:
            raise Rejected("geometry", f"one slab ({slab_bytes} bytes) does not fit in {cap} bytes")
        if old is not None:          # the same engine on a new connection
            old.identity, old.last_seen = identity, self.clock()
            log.info("engine %s reconnected", m.engine_id)
            return p.Registered(engine_id=m.engine_id, budget_bytes=budget, page_size=self.page_size,
                                max_slabs=old.max_slabs)
        max_slabs = max(cap // slab_bytes, max(m.held, default=-1) + 1)
        engine = EngineRecord(
            engine_id=m.engine_id, namespace=m.namespace, pid=m.pid, page_size=self.page_size,
            pages_per_worker=m.pages_per_worker, num_workers=m.num_workers,
            blocks_per_slab=m.blocks_per_slab, block_bytes=m.block_bytes, block_tokens=m.block_tokens,
            key_group_suffix=m.key_group_suffix, min_bytes=m.min_bytes,
            max_bytes=m.max_bytes, max_slabs=max_slabs, device=device, identity=identity,
            last_seen=self.clock())
        for slab_id in m.held:       # re-register after a daemon restart: adopt what it holds
            engine.slabs[slab_id] = SlabRecord(slab_id, [], [], Phase.HELD, set(), engine.pages_per_slab)
            self.devices[device].pool.adopted += engine.pages_per_slab
            engine.mirror.slabs[slab_id] = tuple(m.occupancy.get(slab_id, (0, 0, m.blocks_per_slab)))
        self.engines[m.engine_id] = engine
        log.info("engine %s registered: namespace %s, pid %d, %d worker(s), slab %d bytes, "
                 "virtual capacity %d slabs%s", m.engine_id, m.namespace, m.pid, m.num_workers,
                 slab_bytes, max_slabs, f", adopted {len(m.held)} slab(s)" if m.held else "")
        return p.Registered(engine_id=m.engine_id, budget_bytes=budget, page_size=self.page_size,
                            max_slabs=max_slabs)

    def _on_register_worker(self, identity: bytes, m: p.RegisterWorker) -> p.Msg:
        if m.version != p.PROTOCOL_VERSION:
            raise Rejected("version", f"protocol version {m.version}; this daemon speaks {p.PROTOCOL_VERSION}")
        engine = self._engine(m.engine_id)
        if not 0 <= m.rank < engine.num_workers:
            raise Rejected("bad_rank", f"rank {m.rank} of engine {m.engine_id} with {engine.num_workers} workers")
        device = m.device or engine.device
        if device not in self.devices:
            raise Rejected("unknown_device", f"device {device!r}; this daemon has {', '.join(self.devices)}")
        self.peers.accept()  # its page channel was opened just before this message
        if self.peers.find(m.engine_id, m.rank) is None:
            raise Rejected("no_channel", f"worker {m.rank} of {m.engine_id} has not opened its page channel")
        engine.workers[m.rank] = identity
        engine.worker_devices[m.rank] = device
        log.info("engine %s: worker %d registered (pid %d)", m.engine_id, m.rank, m.pid)
        self._progress_grows()
        return p.Registered(engine_id=engine.engine_id, budget_bytes=self.devices[device].budget_bytes,
                            page_size=self.page_size, max_slabs=engine.max_slabs,
                            pages_per_worker=engine.pages_per_worker)

    def _on_heartbeat(self, identity: bytes, m: p.Heartbeat) -> None:
        engine = self._engine(m.engine_id)
        engine.last_seen = self.clock()
        engine.identity = identity

    def _on_unregister(self, identity: bytes, m: p.Unregister) -> p.Msg:
        self._drop_engine(self._engine(m.engine_id), "unregistered")
        return p.Ok()

    def _on_set_limit(self, identity: bytes, m: p.SetLimit) -> p.Msg:
        engine = self._engine(m.engine_id)
        if m.min_bytes < 0 or m.max_bytes < 0 or (m.max_bytes and m.min_bytes > m.max_bytes):
            raise Rejected("limit", f"need 0 <= min <= max, got min {m.min_bytes} max {m.max_bytes}")
        if m.min_bytes > self.devices[engine.device].budget_bytes:
            raise Rejected("limit", f"min {m.min_bytes} exceeds the device budget")
        engine.min_bytes, engine.max_bytes = m.min_bytes, m.max_bytes
        log.info("engine %s: limits set to min %d max %d bytes", engine.engine_id, m.min_bytes, m.max_bytes)
        return p.Ok()

    def _on_invalidate(self, identity: bytes, m: p.Invalidate) -> p.Msg:
        targets = [e for e in self.engines.values() if m.target in (e.engine_id, e.namespace)]
        if not targets:
            raise Rejected("unknown_target", f"no engine or namespace called {m.target!r}")
        for engine in targets:
            self._command(engine.identity, p.ClearIndex())
            log.info("engine %s: prefix cache invalidated (%s)", engine.engine_id, m.target)
        return p.Ok()

    def _on_status(self, identity: bytes, m: p.Status) -> p.Msg:
        return p.StatusReply(status=self.status())

    # ------------------------------------------------------------ journal
    def _on_journal(self, identity: bytes, m: p.Journal) -> None:
        engine = self._engine(m.engine_id)
        for op in m.ops:
            if not op or op[0] not in _JOURNAL_ARITY or len(op) != _JOURNAL_ARITY[op[0]]:
                raise Rejected("bad_journal", f"malformed journal op {op!r:.80}")
            if op[0] in (STORE, REMOVE) and not isinstance(op[1], bytes):
                raise Rejected("bad_journal", "journal keys must be bytes")
        for slab_id, occ in m.occupancy.items():
            if len(occ) != 3 or sum(occ) != engine.blocks_per_slab or min(occ) < 0:
                raise Rejected("bad_journal", f"slab {slab_id}: occupancy {occ} does not add up to "
                                              f"{engine.blocks_per_slab} blocks")
        engine.apply_journal(JournalBatch(m.ops, m.occupancy), self.clock())
        engine.stats.update(m.stats)
        if self.events is not None:
            self.events.publish(p.kv_events_topic(engine.engine_id, engine.namespace),
                                journal_events(m.ops, engine.block_tokens, engine.key_group_suffix, self._medium))
        engine.last_seen = self.clock()

    # -------------------------------------------------------------- grow
    def _on_grow(self, identity: bytes, m: p.Grow) -> None:
        engine = self._engine(m.engine_id)
        if not 1 <= m.slabs <= MAX_GROW:
            raise Rejected("bad_request", f"grow by {m.slabs} slabs (1..{MAX_GROW})")
        self.grows.append(GrowRequest(engine.engine_id, identity, m.req_id, m.slabs, self.clock(), m.demand))
        self._progress_grows()
        return None

    def _progress_grows(self) -> None:
        """Advance every pending grow. Re-entrant calls (a grant completing inside
        the loop) just ask the running pass to go round once more."""
        if self._progressing:
            self._progress_again = True
            return
        self._progressing = True
        try:
            self._progress_again = True
            while self._progress_again:
                self._progress_again = False
                self._progress_pass()
        finally:
            self._progressing = False

    def _progress_pass(self) -> None:
        for req in list(self.grows):
            if req not in self.grows:
                continue
            engine = self.engines.get(req.engine_id)
            if engine is None:
                self.grows.remove(req)
                continue
            if len(engine.workers) < engine.num_workers:
                continue  # every worker must be there to map the pages
            cap = engine.max_slabs if not engine.max_bytes else min(
                engine.max_slabs, engine.max_bytes // engine.slab_bytes)
            while len(req.slabs) + len(req.mapping) < req.wanted and engine.owned_slabs() < cap:
                slab_id = engine.free_slab_id()
                taken = None if slab_id is None else self._take_pages(engine)
                if taken is None:
                    break
                self._start_map(engine, slab_id, *taken, req)
            short = req.wanted - len(req.slabs) - len(req.mapping)
            # A reserve refill never takes memory from another engine (no ping-pong).
            if short > 0 and req.demand and engine.owned_slabs() < cap and req.reclaims_out == 0 \
                    and req.reclaim_rounds < 3 and not self._unmapping():
                req.reclaim_rounds += 1
                self._reclaim_for(req, engine, short)
            if req.mapping or req.reclaims_out or (short > 0 and self._unmapping()):
                continue
            self.grows.remove(req)
            latency = self.clock() - req.started
            self.metrics.grant_latency.labels(engine.device).observe(latency)
            self._send(req.identity, p.Granted(req_id=req.req_id, slabs=req.slabs))
            if req.slabs:
                log.info("engine %s: granted %d slab(s) in %.1f ms (asked %d)", engine.engine_id,
                         len(req.slabs), latency * 1e3, req.wanted)
            else:
                log.info("engine %s: grow of %d slab(s) refused: device budget exhausted", engine.engine_id,
                         req.wanted)

    def _unmapping(self) -> bool:
        return any(s.phase is Phase.UNMAPPING for e in (*self.engines.values(), *self.departing.values())
                   for s in e.slabs.values())

    def _take_pages(self, engine: EngineRecord) -> tuple[list[int], list[str]] | None:
        """Pages for one slab of ``engine``, rank by rank from each worker's
        device (all or none): reused, scrubbed or created."""
        owner = owner_tag(engine)
        ranks = [(engine.worker_devices.get(r, engine.device), engine.pages_per_worker)
                 for r in range(engine.num_workers)] or [(engine.device, engine.pages_per_worker)]
        pages: list[int] = []
        devices: list[str] = []
        for device, n in ranks:
            got = self.devices[device].take(n, owner)
            if got is None:
                for page_id, dev in zip(pages, devices):
                    self.devices[dev].give_back([page_id], owner)
                return None
            pages += got
            devices += [device] * n
        return pages, devices

    def _start_map(self, engine: EngineRecord, slab_id: int, pages: list[int], page_devices: list[str],
                   req: GrowRequest | None) -> None:
        slab = SlabRecord(slab_id, pages, page_devices, Phase.MAPPING, set(range(engine.num_workers)))
        engine.slabs[slab_id] = slab
        if req is not None:
            req.mapping.add(slab_id)
        for rank in range(engine.num_workers):
            mine = pages[rank * engine.pages_per_worker:(rank + 1) * engine.pages_per_worker]
            if not self._send_pages(engine, rank, mine, engine.worker_devices[rank]):
                slab.waiting.discard(rank)
                continue
            offsets = engine.worker_offsets(slab_id, rank)
            self._command(engine.workers[rank], p.MapSlab(slab=slab_id, pages=list(zip(mine, offsets))))
        if not slab.waiting:
            self._mapped(engine, slab)

    def _send_pages(self, engine: EngineRecord, rank: int, page_ids: list[int], device: str) -> bool:
        peer = self.peers.find(engine.engine_id, rank)
        if peer is None:
            return False
        fds = [self.devices[device].export(pid) for pid in page_ids]
        try:
            peer.channel.send(list(zip(page_ids, fds)))
            return True
        except OSError as exc:
            log.warning("engine %s: page channel of worker %d failed: %s", engine.engine_id, rank, exc)
            return False
        finally:
            for fd in fds:
                os.close(fd)

    def _on_mapped(self, identity: bytes, m: p.Mapped) -> None:
        engine = self._engine(m.engine_id)
        slab = engine.slabs.get(m.slab)
        if slab is None or slab.phase is not Phase.MAPPING or m.rank not in slab.waiting:
            raise Rejected("unexpected_ack", f"engine {m.engine_id} worker {m.rank}: no map of slab {m.slab} pending")
        slab.waiting.discard(m.rank)
        if m.error:
            log.error("engine %s: worker %d could not map slab %d: %s", m.engine_id, m.rank, m.slab, m.error)
            slab.failed = True
        if not slab.waiting:
            self._mapped(engine, slab)
        return None

    def _mapped(self, engine: EngineRecord, slab: SlabRecord) -> None:
        req = next((r for r in self.grows if slab.slab_id in r.mapping and r.engine_id == engine.engine_id), None)
        if req is not None:
            req.mapping.discard(slab.slab_id)
        if slab.failed:
            self._start_unmap(engine, slab)
        else:
            slab.phase = Phase.HELD
            engine.mirror.slabs[slab.slab_id] = (0, 0, engine.blocks_per_slab)
            engine.active[slab.slab_id] = self.clock()
            engine.grants += 1
            if req is not None:
                req.slabs.append(slab.slab_id)
        self._progress_grows()

    # ------------------------------------------------------ return / reclaim
    def _on_return(self, identity: bytes, m: p.Return) -> p.Msg:
        engine = self._engine(m.engine_id)
        for slab_id in m.slabs:
            slab = engine.slabs.get(slab_id)
            if slab is None or slab.phase is not Phase.HELD:
                raise Rejected("not_held", f"engine {m.engine_id} does not hold slab {slab_id}")
        if len(set(m.slabs)) != len(m.slabs):
            raise Rejected("not_held", f"engine {m.engine_id} returned a slab twice in one message")
        # The reply waits until every worker unmapped: then the memory is really back.
        self._return_waits[(identity, m.req_id)] = len(m.slabs)
        log.info("engine %s: returned %d slab(s)", engine.engine_id, len(m.slabs))
        for slab_id in m.slabs:
            engine.returns += 1
            engine.slabs[slab_id].return_req = (identity, m.req_id)
            self._start_unmap(engine, engine.slabs[slab_id])
        return None

    def _reclaim_for(self, req: GrowRequest, requester: EngineRecord, short: int) -> None:
        outstanding = {(eid, s) for eid, slabs, _r, _d in self.reclaims.values() for s in slabs}
        victims = [(e, s) for e, s in pick_victims(list(self.engines.values()), requester,
                                                   short * requester.slab_bytes)
                   if (e.engine_id, s) not in outstanding]
        by_engine: dict[str, list[int]] = {}
        for engine, slab_id in victims:
            by_engine.setdefault(engine.engine_id, []).append(slab_id)
        deadline = self.clock() + RECLAIM_TIMEOUT
        for engine_id, slabs in by_engine.items():
            rid = self._command(self.engines[engine_id].identity, p.Reclaim(slabs=slabs))
            self.reclaims[rid] = (engine_id, slabs, req, deadline)
            req.reclaims_out += 1
            log.info("engine %s: asked to give up %d slab(s) for engine %s", engine_id, len(slabs),
                     requester.engine_id)

    def _on_reclaim_done(self, identity: bytes, m: p.ReclaimDone) -> None:
        entry = self.reclaims.get(m.req_id)
        if entry is None or entry[0] != m.engine_id:
            raise Rejected("unexpected_ack", f"engine {m.engine_id}: no reclaim {m.req_id} pending")
        engine_id, slabs, req, _deadline = entry
        if not set(m.given) <= set(slabs) or not set(m.refused) <= set(slabs):
            raise Rejected("bad_request", f"engine {m.engine_id} answered for slabs it was not asked for")
        del self.reclaims[m.req_id]
        engine = self._engine(m.engine_id)
        for slab_id in m.given:
            slab = engine.slabs.get(slab_id)
            if slab is not None and slab.phase is Phase.HELD:
                engine.reclaims += 1
                self._start_unmap(engine, slab)
        if m.refused:
            log.info("engine %s: refused %d slab(s) (in use again)", m.engine_id, len(m.refused))
        if req is not None:
            req.reclaims_out -= 1
        self._progress_grows()

    def _start_unmap(self, engine: EngineRecord, slab: SlabRecord) -> None:
        slab.phase = Phase.UNMAPPING
        slab.waiting = {rank for rank in range(engine.num_workers)
                        if rank in engine.workers and self.peers.find(engine.engine_id, rank) is not None}
        engine.mirror.slabs.pop(slab.slab_id, None)
        for rank in slab.waiting:
            self._command(engine.workers[rank],
                          p.UnmapSlab(slab=slab.slab_id, offsets=engine.worker_offsets(slab.slab_id, rank)))
        if not slab.waiting:
            self._unmapped(engine, slab)

    def _on_unmapped(self, identity: bytes, m: p.Unmapped) -> None:
        engine = self.engines.get(m.engine_id) or self.departing.get(m.engine_id)
        slab = engine.slabs.get(m.slab) if engine else None
        if slab is None or slab.phase is not Phase.UNMAPPING or m.rank not in slab.waiting:
            raise Rejected("unexpected_ack", f"engine {m.engine_id} worker {m.rank}: no unmap of slab {m.slab} pending")
        slab.waiting.discard(m.rank)
        if not slab.waiting:
            self._unmapped(engine, slab)

    def _unmapped(self, engine: EngineRecord, slab: SlabRecord) -> None:
        """Every worker let go of the slab: its pages are free in the daemon."""
        del engine.slabs[slab.slab_id]
        engine.active.pop(slab.slab_id, None)
        if slab.return_req in self._return_waits:
            self._return_waits[slab.return_req] -= 1
            if self._return_waits[slab.return_req] == 0:
                identity, req_id = slab.return_req
                del self._return_waits[slab.return_req]
                self._send(identity, p.Ok(req_id=req_id))
        owner = owner_tag(engine)
        for page_id, device in zip(slab.pages, slab.page_devices):
            self.devices[device].give_back([page_id], owner)
        self.devices[engine.device].pool.adopted -= slab.adopted_pages
        if engine.engine_id in self.departing and not engine.slabs:
            del self.departing[engine.engine_id]
            log.info("engine %s: all memory back in the pool", engine.engine_id)
        self._progress_grows()

    # ---------------------------------------------------------- engine death
    def _drop_engine(self, engine: EngineRecord, why: str) -> None:
        if self.engines.get(engine.engine_id) is not engine:
            return
        del self.engines[engine.engine_id]
        self.grows = [r for r in self.grows if r.engine_id != engine.engine_id]
        for rid in [rid for rid, entry in self.reclaims.items() if entry[0] == engine.engine_id]:
            _eid, _slabs, req, _d = self.reclaims.pop(rid)
            if req is not None:
                req.reclaims_out -= 1
        level = logging.INFO if why == "unregistered" else logging.WARNING
        if self.events is not None:  # its prefix cache is gone with it
            self.events.publish(p.kv_events_topic(engine.engine_id, engine.namespace), [p.AllBlocksCleared()])
        log.log(level, "engine %s %s: returning its %d slab(s)", engine.engine_id,
                why if why == "unregistered" else f"gone ({why})", len(engine.slabs))
        self.departing[engine.engine_id] = engine
        for slab in list(engine.slabs.values()):
            if slab.phase is not Phase.UNMAPPING:
                self._start_unmap(engine, slab)
        if not engine.slabs:
            self.departing.pop(engine.engine_id, None)
        self._progress_grows()

    def _tick(self, now: float) -> None:
        for engine in list(self.engines.values()):
            if now - engine.last_seen > HEARTBEAT_TIMEOUT:
                self._drop_engine(engine, f"no heartbeat for {now - engine.last_seen:.1f} s")
        for rid, (engine_id, slabs, req, deadline) in list(self.reclaims.items()):
            if now > deadline:
                del self.reclaims[rid]
                log.warning("engine %s: no answer to a reclaim of %d slab(s): treated as refused",
                            engine_id, len(slabs))
                if req is not None:
                    req.reclaims_out -= 1
        if self.reclaims or self.grows:
            self._progress_grows()
        self._scrub_one()

    def _scrub_one(self) -> None:
        for device in self.devices.values():
            if device.scrub_one():
                return

    # --------------------------------------------------------------- peers
    def _on_peer_closed(self, fd: int) -> None:
        peer = self.peers.drop(fd)
        engine = self.engines.get(peer.engine_id)
        departing = self.departing.get(peer.engine_id)
        if departing is not None:          # a dead engine's worker is gone: nothing maps its pages now
            for slab in list(departing.slabs.values()):
                slab.waiting.discard(peer.rank)
                if not slab.waiting:
                    self._unmapped(departing, slab)
        # A worker that never finished registering (e.g. it came back before its
        # engine after a daemon restart) takes nothing with it.
        if engine is not None and (peer.rank < 0 or peer.rank in engine.workers) \
                and self.peers.find(peer.engine_id, peer.rank) is None:
            who = "engine" if peer.rank < 0 else f"worker {peer.rank}"
            engine.workers.pop(peer.rank, None)
            self._drop_engine(engine, f"{who} disconnected")

    # -------------------------------------------------------------- status
    def status(self) -> dict:
        engines = []
        held = dict.fromkeys(self.devices, 0)
        cached = dict.fromkeys(self.devices, 0)
        for e in (*self.engines.values(), *self.departing.values()):
            per_page = e.page_size
            for slab in e.slabs.values():
                for device in slab.page_devices or [e.device] * slab.adopted_pages:
                    held[device] += per_page
        for e in self.engines.values():
            e_cached = e.cached_bytes()
            cached[e.device] += e_cached
            engines.append({
                "engine_id": e.engine_id, "namespace": e.namespace, "pid": e.pid, "device": e.device,
                "workers": len(e.workers), "slabs": len(e.slabs), "slab_bytes": e.slab_bytes,
                "held_bytes": e.held_bytes(), "cached_bytes": e_cached,
                "live_blocks": sum(o[0] for o in e.mirror.slabs.values()),
                "cached_blocks": sum(o[1] for o in e.mirror.slabs.values()),
                "min_bytes": e.min_bytes, "max_bytes": e.max_bytes,
                "grants": e.grants, "returns": e.returns, "reclaims": e.reclaims,
                "stats": dict(e.stats),
            })
        devices = [d.status(held[name], cached[name]) for name, d in self.devices.items()]
        first = devices[0]
        total = {key: sum(d["memory"][key] for d in devices) for key in first["memory"]}
        pages = {key: sum(d["pages"][key] for d in devices) for key in first["pages"]}
        return {
            "device": first["device"], "backend": first["backend"], "page_size": self.page_size,
            "budget_bytes": sum(d["budget_bytes"] for d in devices), "memory": total, "pages": pages,
            "devices": devices, "engines": engines,
        }

    def check(self) -> None:
        """Invariants 1 and 2 on every device (used by the tests)."""
        in_slabs: dict[str, list[int]] = {name: [] for name in self.devices}
        adopted = dict.fromkeys(self.devices, 0)
        for e in (*self.engines.values(), *self.departing.values()):
            for s in e.slabs.values():
                for page_id, device in zip(s.pages, s.page_devices):
                    in_slabs[device].append(page_id)
                adopted[e.device] += s.adopted_pages
        for name, device in self.devices.items():
            device.check(in_slabs[name], adopted[name])


def sd_notify(state: str) -> None:
    """systemd's readiness protocol (Type=notify), without a dependency."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(addr)
        sock.sendall(state.encode())
