"""The daemon's loop: sockets in, effects out, the allocator in between.

One thread owns every socket: a ZMQ ROUTER for requests, the AF_UNIX peers
(``peers.py``: page channels, and lifelines whose closing says a peer died)
and the KV event stream (``events.py``). Each pass reads without blocking,
decodes, hands each input to the ``Allocator`` (which decides, with no I/O)
and performs the effects it returns. Every tick (0.1 s) it publishes an
immutable status snapshot: ``/metrics`` reads only that, never the
allocator's books from another thread (``status`` and ``top`` ask the loop).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.allocator import Allocator
from kvelastic.daemon.devices import Device
from kvelastic.daemon.events import KVEventPublisher, TierStream
from kvelastic.daemon.keeping import PageKeeper
from kvelastic.daemon.peers import Access, Peer, PeerTable
from kvelastic.daemon.requests import Timing
from kvelastic.daemon.succession import Succession, state_path, take_back
from kvelastic.daemon.tenancy import Credential, Tenancy
from kvelastic.daemon.tier_io import TierIO
from kvelastic.errors import require
from kvelastic.metrics import DaemonMetrics
from kvelastic.status_report import StatusReport
from kvelastic.tier.index import TierIndex
from kvelastic.tier.store import StoredBlock, TierStore
from kvelastic.vmm.errors import FdChannelError, VmmError

log = logging.getLogger("kvelastic.daemon")

TICK_INTERVAL = 0.1
# Engines' journals on their lifelines are read at least this often (and
# before anything else of the engine is handled): an engine ships its journal
# every 50 ms (``EngineClient.journal_interval``), so the daemon's books lag
# its pool by at most about twice that.
JOURNAL_READ_INTERVAL = 0.05
MAX_FRAMES_PER_PASS = 256
CREDENTIALS_CACHED = 4096      # peers whose credentials are remembered (by address)
# What a frame's decoding may raise on hostile input (msgspec also raises
# these two for invalid UTF-8 and deep nesting).
_UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


class Daemon:
    def __init__(self, devices: list[Device], socket_path: str, *,
                 clock: Callable[[], float] = time.monotonic,
                 kv_events: tuple[str, str, int] | None = None, timing: Timing = Timing(),
                 access: Access | None = None, max_engines: int = 256, hash_secret: bytes | None = None,
                 tenancy: Tenancy | None = None, tier: TierIndex | None = None,
                 tier_store: TierStore | None = None, tier_found: list[StoredBlock] | None = None,
                 keeper: PageKeeper | None = None, tier_events: TierStream | None = None) -> None:
        """``tier``, ``tier_store``: the node's tier (``main.open_tier``), or None;
        ``tier_found``: what its store held at start (published, where labelled);
        ``tier_events``: where the tier's blocks are published (``events.tier_stream``), None: nowhere.
        ``keeper``: where pages are deposited so they outlive this process, or None."""
        self.devices = {d.name: d for d in devices}
        self.tier_store = tier_store
        self.tier_io = TierIO(self.devices, tier_store)
        self._tier_wake = self.tier_io.writer.wake_fd if self.tier_io.writer is not None else -1
        self._tier_read_wake = self.tier_io.reader.wake_fd if self.tier_io.reader is not None else -1
        self.keeper = keeper
        self.clock = clock
        self.allocator = Allocator({d.name: d.budget_pages for d in devices}, devices[0].page_size,
                                   backend=devices[0].backend.name, timing=timing,
                                   events=kv_events is not None or bool(tier_events and tier_events.endpoint),
                                   max_engines=max_engines, hash_secret=hash_secret,
                                   aliases={a: d.name for d in devices for a in d.aliases}, tier=tier)
        self.snapshot = self.allocator.status()
        self.metrics = DaemonMetrics(lambda: self.snapshot, list(self.devices))
        self.socket_path = socket_path
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, 16 * p.MAX_MESSAGE_BYTES)
        access = access or Access()
        # The same who-may-connect rule as the page channel, checked by libzmq
        # with the peer's credentials (root, the daemon's user, its group).
        for uid in sorted({0, access.uid}):
            self.router.setsockopt(zmq.IPC_FILTER_UID, uid)
        self.router.setsockopt(zmq.IPC_FILTER_GID, access.group)
        self.router.bind(f"ipc://{socket_path}")
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        if self._tier_wake >= 0:      # the tier's writer says a write finished
            self.poller.register(self._tier_wake, zmq.POLLIN)
        if self._tier_read_wake >= 0:     # the tier's reader says a fetch is read
            self.poller.register(self._tier_read_wake, zmq.POLLIN)
        self.tenancy = tenancy or Tenancy(daemon_uid=access.uid)
        self.peers = PeerTable(p.fd_socket_path(socket_path), self.poller, access, self.tenancy,
                               _descriptors_per_tenant(sum(d.budget_pages for d in devices)))
        self._creds: dict[str, Credential | None] = {}      # by peer address
        self.events = KVEventPublisher(self.ctx, *kv_events) if kv_events else None
        # The tier's blocks alone, numbered on their own (docs/kv-events.md): a
        # stream a router's indexer can take as one worker's, beside the node's.
        # Its events carry the tenants' token ids: on ipc, only the daemon's
        # user (and root) may connect, not the socket's group; off ipc, only
        # under CURVE or without token ids (``events.tier_stream``).
        self.tier_events = tier_events.open(self.ctx, sorted({0, access.uid})) \
            if tier_events is not None and tier is not None else None
        for publisher in (self.events, self.tier_events):
            if publisher is not None:
                self.poller.register(publisher.replay, zmq.POLLIN)
        self._effects: deque[fx.Effect] = deque()
        # Page creation, one batch per pass of the loop: a large grow never
        # holds it (each batch is at most ``growth.CREATE_BATCH`` pages).
        self._slow: deque[fx.CreatePages] = deque()
        self._draining = False
        self.succession: Succession | None = None     # with a keeper: what the next daemon takes back
        if tier_found:      # routers hear of the blocks rebuilt from disk as of those demoted since
            self._perform(self.allocator.tier_restored(tier_found, time.monotonic()))

    def take_back(self, boot: str) -> None:
        """At start, with a keeper: adopt the kept cache the last daemon saved
        (``succession.py``), then save this daemon's books from now on."""
        require(self.keeper is not None, "taking back needs a keeper")
        assert self.keeper is not None
        path = state_path(self.socket_path)
        now = self.clock()
        take_back(path, boot, self.keeper, self.devices, self.allocator, now)
        self.succession = Succession(path, boot, self.keeper)
        self.succession.save(self.allocator, now)
        self.snapshot = self.allocator.status()

    # ------------------------------------------------------------------ loop
    def serve(self, should_stop: Callable[[], bool]) -> None:
        last_tick = last_journals = 0.0
        while not should_stop():
            replaying = any(e is not None and e.has_work() for e in (self.events, self.tier_events))
            busy = replaying or self._slow or self.allocator.more_work
            ready = dict(self.poller.poll(0 if busy else 50))
            now = self.clock()
            if self.router in ready:
                for _ in range(MAX_FRAMES_PER_PASS):
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._dispatch(frames)
            self._service_peers({fd for fd in ready if isinstance(fd, int)
                                 and fd not in (self._tier_wake, self._tier_read_wake)}, now)
            if self._tier_wake in ready:
                self._tier_writes(now)
            if self._tier_read_wake in ready:
                self._tier_reads(now)
            if now - last_journals >= JOURNAL_READ_INTERVAL:
                last_journals = now
                for fd in self.peers.lifelines():   # they do not wake the loop (``peers.read_greetings``)
                    self._read_peer(fd, now)
            for publisher in (self.events, self.tier_events):
                if publisher is not None and (publisher.replay in ready or publisher.has_work()):
                    publisher.serve_replay()      # a bounded share of the replays in progress
            if self._slow:
                self._perform([self._slow.popleft()], slow=True)
            if self.allocator.more_work:
                self._perform(self.allocator.resume(now))
            if now - last_tick >= TICK_INTERVAL:
                last_tick = now
                try:
                    self._perform(self.allocator.tick(now))
                    self._close_unclaimed(now)
                except Exception:
                    log.exception("internal error in the periodic pass")
                # /metrics reads this from its own thread: a fresh immutable copy
                # each tick (Status requests are answered from the books directly).
                self.snapshot = self._with_reads(self.allocator.status())
                self.metrics.published()

    def _tier_writes(self, now: float) -> None:
        """The tier's writer finished writes: the allocator commits or aborts them."""
        written, failed = self.tier_io.finished()
        if written or failed:
            self._perform(self.allocator.tier_written(written, failed, now))

    def _tier_reads(self, now: float) -> None:
        """The tier's reader read fetches: each answered, and a block done with
        (its last chunk, or failed) reported to the allocator. A block no longer
        servable was invalidated or dropped while read: answered "not served"
        (``TierIO.reads``) and left pinned for the engine's next word on it
        (a fetch of it ends the pin, as does a release, the lease's end)."""
        tier = self.allocator.tiering.tier
        for fetch, reply, error, finished in self.tier_io.reads(tier.servable if tier is not None else _never):
            follow = self.allocator.tier_read(fetch.lease, fetch.block, error, now) \
                if finished and error != "gone" else []
            self._perform([fx.Send(fetch.to, reply), *follow])

    def _tier_fetch(self, effect: fx.ReadTierBlock) -> list[fx.Effect]:
        """Hand a fetch to the tier's reader, with its tenant and engine (the
        lease's), or refuse it ``busy`` (the tenant's share of the reader is
        taken): nothing changes, the engine may fetch again."""
        lease = self.allocator.tiering.leases.get(effect.lease)
        engine = self.allocator.engines.get(lease.engine_id) if lease is not None else None
        tier = self.allocator.tiering.tier
        refused = self.tier_io.read(effect, engine.uid if engine is not None else -1,
                                    lease.engine_id if lease is not None else "",
                                    tier.nbytes(effect.slot) if tier is not None else 0)
        if not refused:
            return []
        message = f"tier fetch refused ({refused}): this tenant's fetches in flight fill its share of the reader"
        return [fx.Rejected(p.Reason.BUSY),
                fx.Send(effect.to, p.Error(req_id=effect.req_id, reason=p.Reason.BUSY.value, message=message))]

    def _with_reads(self, report: StatusReport) -> StatusReport:
        """The status report with the tier's reader's figures (the loop's, not the books')."""
        if report.tier is not None:
            report.tier.reads = self.tier_io.report()
        return report

    def close(self) -> None:
        """Stop without unmapping anything: engines keep serving from the pages
        they hold and adopt them again from the next daemon (invariant 9)."""
        if self.succession is not None:
            self.succession.save(self.allocator, self.clock(), final=True)   # kept and lent, for the next daemon
            self.succession = None        # what follows releases this daemon's handles, not the kept cache
        if self.keeper is not None:
            self.keeper.detach()          # the pages stay with the keeper for the next daemon
            self.keeper = None
        self._perform(self.allocator.shutdown())
        self.tier_io.close()     # what is queued is written: whole blocks, found by the next daemon
        self.peers.close()
        self.router.close(0)
        for publisher in (self.events, self.tier_events):
            if publisher is not None:
                publisher.close()
        for path in (self.socket_path, p.fd_socket_path(self.socket_path)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for device in self.devices.values():
            device.release_all()

    def _service_peers(self, ready: set[int], now: float, eager: bool = False) -> None:
        """Accept, read greetings, notice closed peers. ``eager``: read every
        greeting now (a worker's registration follows its greeting at once)."""
        if eager or not self.peers.listening or self.peers.listener.fileno() in ready:
            self.peers.accept(now)
        opened, bad = self.peers.read_greetings(set(self.peers.greeting) if eager else ready, now)
        for _ in range(bad):
            self.metrics.rejected.labels(p.Reason.BAD_HELLO.value).inc()
        for _ in range(self.peers.refused):
            self.metrics.rejected.labels(p.Reason.NOT_ALLOWED.value).inc()
        for _ in range(self.peers.over_limit):
            self.metrics.rejected.labels(p.Reason.CHANNEL_LIMIT.value).inc()
        self.peers.refused = self.peers.over_limit = 0
        for opened_peer in opened:
            self._perform(self.allocator.peer_opened(opened_peer.engine_id, opened_peer.rank, now,
                                                     opened_peer.token))
        for fd in ready:
            peer = self.peers.by_fd.get(fd)    # (one read above may have closed another)
            if peer is None:
                continue
            if peer.rank >= 0:   # what its engine shipped before this worker went comes first
                self._read_lifeline(peer.engine_id, now)
            self._read_peer(fd, now)

    def _read_peer(self, fd: int, now: float) -> None:
        """Handle what the peer on ``fd`` sent, in order, then its closing."""
        peer = self.peers.by_fd.get(fd)
        if peer is None:
            return
        frames, closed = self.peers.receive(fd)
        for frame in frames:
            self._dispatch_frame(peer, frame, now)
        if closed and fd in self.peers.by_fd:
            self.peers.drop(fd)
            self._perform(self.allocator.peer_closed(peer.engine_id, peer.rank, now, peer.token))

    def _read_lifeline(self, engine_id: str, now: float) -> None:
        """Apply what the registered engine ``engine_id`` wrote on its lifeline
        so far. Called before anything else of that engine is handled (a
        message on the control socket, a worker of it gone): it wrote its
        journal there first, so the daemon's books follow its order."""
        engine = self.allocator.engines.get(engine_id)
        peer = self.peers.find(engine_id, -1, engine.token) if engine is not None else None
        if peer is not None:
            self._read_peer(peer.channel.fileno(), now)

    def _dispatch_frame(self, peer: Peer, frame: bytes, now: float) -> None:
        """A frame on a page channel or lifeline: handled as if it came on the
        control socket of whoever registered with that channel's engine, rank
        and secret (a worker's ``Mapped``/``Unmapped``, an engine's ``Journal``);
        anything else is refused and counted."""
        lifeline = peer.rank < 0
        expected: tuple[type[p.Msg], ...] = (p.Journal,) if lifeline else (p.Mapped, p.Unmapped)
        try:
            msg = p.decode(frame)
        except _UNDECODABLE as exc:
            msg, why = None, f"undecodable frame: {exc}"
        else:
            why = "" if isinstance(msg, expected) else \
                f"{type(msg).__name__} (only {' and '.join(m.__name__ for m in expected)} go there)"
        if lifeline:
            # The registered engine's lifeline (the first with its secret): the
            # one read before its messages, so the only one its journal may take.
            engine = self.allocator.engines.get(peer.engine_id)
            identity = engine.identity if engine is not None and \
                self.peers.find(peer.engine_id, -1, engine.token) is peer else None
            if identity is not None and isinstance(msg, p.Journal) and \
                    (peer.cred.scope(msg.engine_id) if peer.cred else msg.engine_id) != peer.engine_id:
                identity = None   # a journal names its own engine or none
        else:
            identity = self.allocator.worker_identity(peer.engine_id, peer.rank, peer.token)
        if msg is None or why or identity is None:
            reason = p.Reason.MALFORMED if msg is None else p.Reason.UNEXPECTED if why else p.Reason.NOT_OWNER
            self.metrics.rejected.labels(reason.value).inc()
            if not peer.refused:     # once per channel; every one is counted
                log.warning("%s of %s: %s", "lifeline" if lifeline else f"page channel rank {peer.rank}",
                            peer.engine_id, why or "a frame for a registration it does not belong to")
            peer.refused += 1
            return
        self._perform(self.allocator.handle(identity, msg, now, peer.cred))

    def _close_unclaimed(self, now: float) -> None:
        known = {(e.engine_id, e.token) for e in (*self.allocator.engines.values(),
                                                   *self.allocator.departing.values())}
        for fd in self.peers.unclaimed(known, now):
            peer = self.peers.drop(fd)
            log.warning("page channel of %s rank %d closed: no such engine registered within %g s",
                        peer.engine_id, peer.rank, p.REGISTER_TIMEOUT)
            self._perform(self.allocator.peer_closed(peer.engine_id, peer.rank, now, peer.token))

    def _credential(self, frame: zmq.Frame) -> Credential | None:
        """Who sent ``frame``: libzmq gives every message its connection's
        credentials (``tenancy.py``); None only if it could not. Remembered by
        that address (which the kernel, not the client, wrote), never by the
        routing id, which a client may choose and reuse after another's."""
        try:
            address = str(frame.get("Peer-Address"))
        except zmq.ZMQError:
            address = ""
        if address not in self._creds:
            if len(self._creds) >= CREDENTIALS_CACHED:
                self._creds.clear()
            self._creds[address] = self.tenancy.from_peer_address(address)
        return self._creds[address]

    def _dispatch(self, parts: list[zmq.Frame]) -> None:
        frames = [part.bytes for part in parts]
        identity = frames[0]
        cred = self._credential(parts[-1])
        now = self.clock()
        if len(frames) != 2:
            self._perform(self.allocator.reject(identity, p.Reason.MALFORMED,
                                                f"expected one frame per message, got {len(frames) - 1}"))
            return
        if len(frames[1]) > p.MAX_MESSAGE_BYTES:
            self._perform(self.allocator.reject(identity, p.Reason.OVERSIZE, f"message of {len(frames[1])} bytes "
                                                f"exceeds {p.MAX_MESSAGE_BYTES}"))
            return
        try:
            msg = p.decode(frames[1])
        except _UNDECODABLE as exc:
            self._perform(self.allocator.reject(identity, p.Reason.MALFORMED, f"cannot decode message: {exc}",
                                                _req_id_of(frames[1])))
            return
        if isinstance(msg, p.RegisterWorker):
            self._service_peers(set(), now, eager=True)  # its greeting was sent just before
        if cred is None:    # every ipc peer has credentials: refuse rather than trust
            self._perform(self.allocator.reject(identity, p.Reason.NOT_ALLOWED, "no peer credentials", msg.req_id))
            return
        engine_id = getattr(msg, "engine_id", None)
        if isinstance(engine_id, str) and self.peers.by_key:   # its journal, written before this was sent
            self._read_lifeline(cred.scope(engine_id), now)
        try:
            effects = self.allocator.handle(identity, msg, now, cred)
        except Exception as exc:  # a bug must not take the node's memory manager down
            log.exception("internal error handling %s", type(msg).__name__)
            effects = self.allocator.reject(identity, p.Reason.INTERNAL, f"internal error: {type(exc).__name__}: {exc}",
                                            msg.req_id)
        self._perform(effects)

    # --------------------------------------------------------------- effects
    def _perform(self, effects: list[fx.Effect], slow: bool = False) -> None:
        """Carry out effects in order; what they set off (failures fed back to
        the allocator) runs after them, in the same call; page creation waits
        for a pass of its own (``slow``: this is that pass)."""
        for effect in effects:
            if isinstance(effect, fx.CreatePages) and not slow:
                self._slow.append(effect)
            else:
                self._effects.append(effect)
        if self._draining:
            return
        self._draining = True
        try:
            while self._effects:
                effect = self._effects.popleft()
                try:
                    for follow in self._do(effect):
                        if isinstance(follow, fx.CreatePages):
                            self._slow.append(follow)
                        else:
                            self._effects.append(follow)
                except Exception:  # a bug must not take the node's memory manager down
                    log.exception("internal error performing %s", type(effect).__name__)
                    self.metrics.rejected.labels(p.Reason.INTERNAL.value).inc()
            if self.succession is not None:   # the kept cache as this input left it, before any reply after
                self.succession.save(self.allocator, self.clock())
        finally:
            self._draining = False

    def _do(self, effect: fx.Effect) -> list[fx.Effect]:
        now = self.clock()
        if isinstance(effect, fx.Send):
            if effect.channel is not None and self._send_on_channel(effect.channel, effect.msg):
                return []
            if isinstance(effect.msg, p.StatusReply):
                self._with_reads(effect.msg.status)
            try:
                self.router.send_multipart([effect.to, p.encode(effect.msg)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("could not send %s: %s", type(effect.msg).__name__, exc)
        elif isinstance(effect, fx.SendPages):
            return self._send_pages(effect, now)
        elif isinstance(effect, fx.CreatePages):
            ids = self.allocator.new_page_ids(effect.count)
            device = self.devices[effect.device]
            created = device.create(ids)
            if self.keeper is not None:
                self.keeper.keep(device, created)
            return self.allocator.pages_created(effect.device, effect.count, created, now)
        elif isinstance(effect, fx.ReleasePages):
            if self.keeper is not None:
                self.keeper.forget(effect.pages)
            self.devices[effect.device].release(effect.pages)
        elif isinstance(effect, fx.Publish):
            stream = self.tier_events if effect.tier else self.events
            if stream is not None:
                stream.publish(effect.topic, list(effect.events))
        elif isinstance(effect, fx.Rejected):
            self.metrics.rejected.labels(effect.reason.value).inc()
        elif isinstance(effect, fx.DeleteTierBlocks):
            self.tier_io.delete(effect.slots)
            self.tier_io.forget(effect.slots)       # the reader lets go of them
            return self.allocator.tier_deleted(effect.slots)     # announced ones: published removed
        elif isinstance(effect, fx.MoveTierBlocks):  # host memory to disk, on the writer: ``_tier_writes``
            failed = self.tier_io.move(effect)
            return self.allocator.tier_written([], failed, now) if failed else []
        elif isinstance(effect, fx.DemoteBlocks):    # read before the ReleasePages that follow it
            staged, failed = self.tier_io.demote(effect)
            if effect.staged:                        # before the TierCopied that follows it
                return self.allocator.tier_copied(staged, failed, now)
            return self.allocator.tier_written([], failed, now) if failed else []   # the writes: ``_tier_writes``
        elif isinstance(effect, fx.WriteStaged):
            cancelled, failed = self.tier_io.write_staged(effect)
            return self.allocator.tier_written(cancelled, failed, now) if cancelled or failed else []
        elif isinstance(effect, fx.ReadTierBlock):   # read off the loop, answered by ``_tier_reads``
            return self._tier_fetch(effect)
        elif isinstance(effect, fx.GrantLatency):
            self.metrics.grant_latency.labels(effect.device).observe(effect.seconds)
            if effect.demand:
                self.metrics.demand_wait.labels(effect.device).observe(effect.seconds)
        return []

    def _send_on_channel(self, channel: tuple[str, int, bytes], msg: p.Msg) -> bool:
        """A command on a worker's page channel (a batch without pages); False
        when it has none or it failed: the control socket takes it then, and
        the ack's deadline judges the worker as ever."""
        peer = self.peers.find(*channel)
        if peer is None:
            return False
        try:
            self.peers.send_pages(peer, [], p.encode(msg))
        except (FdChannelError, OSError) as exc:
            log.warning("engine %s: page channel of worker %d failed: %s", channel[0], channel[1], exc)
            return False
        return True

    def _send_pages(self, effect: fx.SendPages, now: float) -> list[fx.Effect]:
        peer = self.peers.find(effect.engine_id, effect.rank, effect.token)
        if peer is None:
            return self.allocator.channel_failed(effect.engine_id, effect.rank, "no page channel", now)
        if self.succession is not None:    # written ahead: the file never names a slab lent since
            self.succession.save(self.allocator, now)
        device = self.devices[effect.device]
        fds: list[int] = []
        try:
            try:
                for page_id in effect.pages:
                    fds.append(device.export(page_id))
            except (OSError, VmmError) as exc:    # the daemon's fault (out of descriptors): nothing goes out
                return self.allocator.pages_unsent(effect.engine_id, effect.rank, effect.slab,
                                                   f"cannot export page descriptors: {exc}", now)
            # The MapSlab rides with its pages: the worker maps on one read, and
            # neither side's ZMQ I/O thread is woken for it (a grant's latency
            # is the wake-ups on its path, see docs/benchmarks.md).
            command = p.encode(effect.then.msg) if effect.then is not None else b""
            try:
                self.peers.send_pages(peer, list(zip(effect.pages, fds)), command)
            except (FdChannelError, OSError) as exc:
                log.warning("engine %s: page channel of worker %d failed: %s", effect.engine_id, effect.rank, exc)
                return self.allocator.channel_failed(effect.engine_id, effect.rank, str(exc), now)
        finally:
            for fd in fds:
                os.close(fd)
        return []

    # -------------------------------------------------------------- status
    def status(self) -> StatusReport:
        return self.snapshot

    def check(self) -> None:
        self.allocator.check()
        for name, device in self.devices.items():
            held = {pg for e in (*self.allocator.engines.values(), *self.allocator.departing.values())
                    for s in e.slabs.values() for pg, d in zip(s.pages, s.page_devices) if d == name}
            require(set(device.pages) == held | set(self.allocator.pools[name].free), f"device {name}: handles differ")


def _never(slot: int) -> bool:
    return False


def _descriptors_per_tenant(budget_pages: int) -> int:
    """A share of the descriptors left after one per page of the budget."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (soft - budget_pages - 256) // 4


class _RequestId(msgspec.Struct):
    req_id: int = 0


def _req_id_of(frame: bytes) -> int:
    """The request id of a frame that did not decode, if it has one, so the
    sender's request gets its typed error instead of a timeout."""
    try:
        return msgspec.msgpack.decode(frame, type=_RequestId).req_id
    except _UNDECODABLE:
        return 0

