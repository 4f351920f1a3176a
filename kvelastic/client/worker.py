"""The worker side: an arena the daemon's pages are mapped into.

Maps are applied at once, on the I/O thread: new pages land in virtual
addresses no running step reads. Unmaps wait for a safe point (invariant 5):
the caller brackets each model step with ``step()``, and an unmap that
arrives during a step is applied when the step ends; between steps it is
applied at once, and so is one of a settled slab (``UnmapSlab.at_once``: its
engine knows no step in flight writes it). Every map and unmap is acknowledged to the daemon, which
grants a slab only after every worker mapped it and reuses pages only after
every worker let go of them. A map comes on the page channel with its
pages, an unmap on that channel too, and both acks go back on it
(``Connection.tell``): no ZMQ hop between the daemon and a worker on a
grant's or a return's path.

Before any slab arrives, a warm-up (vLLM's dummy runs and CUDA-graph
capture) may read and write any block: ``warm_up()`` backs every empty slot
with one scratch page of the worker's own for its duration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import msgspec

from kvelastic import protocol as p
from kvelastic.client.connection import Connection, expect
from kvelastic.errors import KvelasticError
from kvelastic.vmm import fdchannel
from kvelastic.vmm.base import Arena, Backend

log = logging.getLogger("kvelastic.client")

# Slots a warm-up backs with the scratch page: each is one mapping (a kernel
# memory area on the host backend, whose count vm.max_map_count caps).
MAX_SCRATCH_SLOTS = 32768


class WorkerClient:
    def __init__(self, backend: Backend, *, socket_path: str, engine_id: str, rank: int, device: str = "",
                 token: bytes = b"") -> None:
        self.backend = backend
        self.engine_id = engine_id
        self.rank = rank
        self.device = device
        self.arena: Arena | None = None
        self.max_slabs = 0
        self.slabs: dict[int, list[int]] = {}        # slab id -> offsets mapped here
        self._mu = threading.Lock()
        self._steps = 0            # model steps (or their sampling) in flight
        self._deferred: list[p.UnmapSlab] = []
        self._ack_timeout = p.ACK_TIMEOUT     # the daemon's, from registration
        self._busy_at = 0.0                   # when the daemon last heard that unmaps wait for a step
        self._scratch: set[int] = set()       # offsets the warm-up's scratch page backs
        self._warming = False
        self.warm_up_slots = 0                # slots the last warm-up backed (operators' logs, tests)
        self.conn = Connection(socket_path, engine_id, rank, handshake=self._register,
                               on_command=self._on_command, on_tick=self._tick, on_pages=self._read_pages,
                               tick_interval=0.05,
                               name=f"kvelastic-worker-{engine_id}-{rank}")
        self.conn.token = token    # the engine's secret: descriptors come only to a channel that shows it

    def start(self, timeout: float = 10.0) -> WorkerClient:
        self.conn.start(timeout)
        return self

    def close(self) -> None:
        self.conn.close()
        if self.arena is not None:
            self.arena.close()

    def reserved_arena(self) -> Arena:
        """The arena: reserved at the first registration, so there once ``start`` returns."""
        if self.arena is None:
            raise KvelasticError(f"worker {self.rank} of engine {self.engine_id} has no arena: it is reserved "
                                 "when the worker registers (start)")
        return self.arena

    def _register(self, conn: Connection) -> None:
        reply = expect(conn.call(p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=self.engine_id,
                                                  rank=self.rank, pid=os.getpid(), device=self.device,
                                                  mapped=sorted(self.slabs), token=conn.token), timeout=5.0),
                       p.Registered)
        self._ack_timeout = reply.ack_timeout
        if self.arena is None:
            # The engine's whole virtual capacity: one region per page of a slab.
            self.max_slabs = reply.max_slabs
            self.arena = self.backend.reserve(reply.page_size * reply.max_slabs * reply.pages_per_worker)

    # -------------------------------------------------------- safe points
    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Bracket a model step (or its sampling): no page is unmapped while one runs."""
        with self._mu:
            self._steps += 1
        try:
            yield
        finally:
            with self._mu:
                self._steps -= 1
                deferred = [] if self._steps else self._deferred
                if not self._steps:
                    self._deferred = []
            for msg in deferred:
                self._unmap(msg)

    @contextlib.contextmanager
    def warm_up(self, limit: int = MAX_SCRATCH_SLOTS) -> Iterator[int]:
        """Back every empty slot of the arena with one zeroed scratch page
        while vLLM warms up and captures CUDA graphs (yields the slots backed).

        Why: those passes run before the engine holds any slab -- dummy runs
        read block 0, kernel warm-ups write blocks 1.., some verifications
        span every block -- and an unmapped slot faults. What they write is
        thrown away with the scratch page. A captured graph keeps addresses,
        not pages, and the arena never moves: once the scratch is gone the
        daemon's pages answer at the same addresses. A slab the daemon maps
        meanwhile replaces the scratch at its offsets (``_map``).
        """
        if self._warming:                  # nested (a subclass's warm-up calls its parent's): one scratch
            yield len(self._scratch)
            return
        arena = self.reserved_arena()
        ps = arena.page_size
        page = self.backend.create_page()
        try:
            with self._mu:
                for offset in range(0, arena.size, ps):
                    if len(self._scratch) >= limit:
                        break
                    if not arena.is_mapped(offset):
                        arena.map(offset, page)
                        self._scratch.add(offset)
                backed = self.warm_up_slots = len(self._scratch)
        except BaseException:
            self._drop_scratch()
            raise
        finally:
            self.backend.release_page(page)    # the mappings keep it alive until the last is gone
        log.info("kvelastic: worker %d of engine %s: warm-up over %d scratch-backed slot(s) of %d",
                 self.rank, self.engine_id, backed, arena.size // ps)
        self._warming = True
        try:
            yield backed
        finally:
            self._warming = False
            self._drop_scratch()

    def _drop_scratch(self) -> None:
        with self._mu:
            if not self._scratch:
                return
            self.backend.synchronize()     # warm-up kernels may still run over the scratch page
            arena = self.reserved_arena()
            for offset in self._scratch:
                arena.unmap(offset)
            self._scratch.clear()

    # ------------------------------------------------------- I/O thread
    def _on_command(self, msg: p.Msg) -> None:
        if isinstance(msg, p.MapSlab):       # its pages come with it on the page channel, never here
            self.conn.tell(p.Mapped(req_id=msg.req_id, engine_id=self.engine_id, rank=self.rank, slab=msg.slab,
                                    error="MapSlab came without its pages (they come with it on the page channel)"))
        elif isinstance(msg, p.UnmapSlab):
            with self._mu:
                # A settled slab (``at_once``): the step that runs writes none
                # of its pages, and the last that did has finished.
                if self._steps and not msg.at_once:
                    self._deferred.append(msg)
                    self._busy_at = 0.0      # say so now: the step may outlast the ack deadline
                    return
            self._unmap(msg)

    def _tick(self, now: float) -> None:
        """While a step holds unmaps, tell the daemon well within its ack
        deadline (``Busy``), so a long step is never taken for a hung worker."""
        with self._mu:
            waiting = [m.slab for m in self._deferred]
        if waiting and now - self._busy_at >= self._ack_timeout / 4:
            self._busy_at = now
            self.conn.send(p.Busy(engine_id=self.engine_id, rank=self.rank, slabs=waiting))

    def _read_pages(self, lifeline: fdchannel.FdChannel) -> None:
        """I/O thread: the lifeline is readable and not closed: a batch of
        pages with the ``MapSlab`` that names them (mapped at once), or an
        ``UnmapSlab`` without pages."""
        pairs, command = lifeline.recv_batch()
        fds = dict(pairs)
        try:
            msg = p.decode(command)
        except msgspec.DecodeError as exc:
            for fd in fds.values():
                os.close(fd)
            raise fdchannel.FdChannelError(f"pages came with an unreadable command: {exc}") from exc
        if isinstance(msg, p.MapSlab):
            self._map(msg, fds)
            return
        for fd in fds.values():
            os.close(fd)
        if not isinstance(msg, p.UnmapSlab) or fds:
            raise fdchannel.FdChannelError(f"a {type(msg).__name__} with {len(fds)} page(s) on the page channel")
        self._on_command(msg)

    def _map(self, msg: p.MapSlab, fds: dict[int, int]) -> None:
        """Map ``msg``'s pages (``fds``: page id -> descriptor, closed here) and acknowledge."""
        error = ""
        done: list[int] = []
        with self._mu:
            try:
                arena = self.reserved_arena()
                for page_id, offset in msg.pages:
                    page = self.backend.import_page(fds.pop(page_id))
                    if offset in self._scratch:          # a slab during a warm-up: its page wins
                        self._scratch.discard(offset)
                        arena.unmap(offset)
                    try:
                        arena.map(offset, page)
                    finally:
                        # The mapping keeps the memory alive; holding a descriptor
                        # per page would run into the process's file limit.
                        self.backend.release_page(page)
                    done.append(offset)
            except Exception as exc:  # noqa: BLE001 - any failure is reported: the daemon must not wait forever
                error = f"{type(exc).__name__}: {exc}"
                for offset in done:                      # all or nothing
                    arena.unmap(offset)
                done = []
            if done:
                self.slabs[msg.slab] = done
        for fd in fds.values():
            os.close(fd)
        self.conn.tell(p.Mapped(req_id=msg.req_id, engine_id=self.engine_id, rank=self.rank,
                                slab=msg.slab, error=error))

    def _unmap(self, msg: p.UnmapSlab) -> None:
        with self._mu:
            offsets = self.slabs.pop(msg.slab, msg.offsets)
            # Kernels launched by the last step may still read the pages. For
            # a settled slab (``at_once``) that step finished, yet on CUDA this
            # still waits for the device's queued work: kept until measured there.
            self.backend.synchronize()
            arena = self.reserved_arena()
            for offset in offsets:
                if arena.is_mapped(offset):
                    arena.unmap(offset)
        # On the I/O thread (between steps, or a settled slab's during one) or the thread that ended the step.
        self.conn.tell(p.Unmapped(req_id=msg.req_id, engine_id=self.engine_id, rank=self.rank, slab=msg.slab))
