"""The tier's reads off the daemon's loop (docs/tier.md, "Promotion"): the loop
hands each ``TierFetch`` it accepted to this reader and answers it when the
chunk comes back through a descriptor it polls, as the writer's writes do
(``writer.py``). Nothing here waits on the loop, and the loop never waits on
a disk: a tenant whose engines fetch large blocks all day cannot delay
another tenant's journal or an operator's ``status``.

**Fair between tenants.** Fetches queue per engine, engines per tenant (the
registering peer's uid). Each *turn* serves one fetch: the next tenant in
round-robin order, then its next engine, then that engine's oldest fetch.
A tenant has at most one turn running at a time, and ``THREADS`` threads
take turns, so however many connections one tenant opens, another tenant's
fetch waits for no more than one turn of each tenant ahead of it in the
ring, and while fewer tenants than threads are busy, for none.

**Verified whole, then served by the chunk.** A turn for a block not held
for the engine reads it through its store's ``read``, which checks the whole
payload (its checksum) before it returns a byte; the block is then held for
that engine (one block each: today's ``_last``, per engine) and its next
chunks are served from memory, until its last chunk is served, the engine
asks for another block, its slot is deleted (``forget``) or ``IDLE``
seconds pass unasked (a lease given up in the middle of a block).

**Bounded per tenant.** Every byte a tenant makes the reader hold is
charged to it until it leaves: the chunk a queued fetch will answer with
and the block it will read, the blocks held for its engines, and the
answers not yet taken by the loop. A fetch that needs a block read and
would take a tenant past ``MAX_TENANT_BYTES`` is refused (``submit`` says
why; the loop answers ``busy``) and changes nothing. The next chunk of a
block held for the engine is admitted up to ``CONTINUE_SLACK`` past the
share, so a tenant whose engines fill it can always finish the blocks they
hold (which gives the share back), and a tenant with nothing charged always
has one fetch admitted: no block the index holds (``MAX_BLOCK_BYTES`` at
most) is refused for good.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from kvelastic.threadname import name_this_thread
from kvelastic.tier.errors import TierReadError
from kvelastic.tier.index import MAX_BLOCK_BYTES

log = logging.getLogger("kvelastic.daemon")

T = TypeVar("T")

# A tenant's bytes in the reader (queued, held, answered not taken): a block
# held for one engine while the next is read, at the largest block size.
MAX_TENANT_BYTES = 2 * MAX_BLOCK_BYTES
# A fetch of a block already held (or being read) for its engine costs a
# chunk, and may pass the share by this much: an engine can always finish
# the block it is reading, which is what gives a full share back.
CONTINUE_SLACK = 8 << 20
THREADS = 2          # turns at once: one tenant's block read never holds another's turn while few are busy
IDLE = 5.0           # seconds a block held for an engine's next chunks waits to be asked
REFUSALS = ("tenant_bytes",)   # why ``submit`` refuses (a metric label)


class BlockSource(Protocol):
    """What the reader reads from (a ``TierStore``): a block's payload,
    checked whole, or ``TierReadError``."""

    def read(self, slot: int, namespace: str | None = None, key: bytes | None = None) -> bytes: ...


@dataclasses.dataclass(frozen=True)
class ReadJob(Generic[T]):
    """A fetch: ``chunk`` bytes from ``offset`` of the block at ``slot`` (its
    ``nbytes`` as the index has it), for ``engine`` of ``tenant``; ``ticket``
    is the loop's, handed back with the answer."""

    slot: int
    namespace: str
    key: bytes
    nbytes: int
    offset: int
    chunk: int
    tenant: int
    engine: str
    ticket: T


@dataclasses.dataclass(frozen=True)
class ReadDone(Generic[T]):
    """A fetch's answer: ``data`` from the job's offset of a block of ``size``
    bytes, or ``size`` -1 and why (``error``: a ``TierReadError`` reason,
    ``io``, or ``gone``: its slot was deleted while queued); ``finished``:
    the block's last chunk, or a failure (the block is done with)."""

    ticket: T
    size: int
    data: bytes
    error: str
    finished: bool


@dataclasses.dataclass
class _Queued(Generic[T]):
    job: ReadJob[T]
    charge: int                  # charged to its tenant until its turn ends
    gone: bool = False           # its slot was deleted: answered without reading


@dataclasses.dataclass
class _Held:
    slot: int
    payload: bytes               # verified whole
    used: float                  # when a chunk of it was last asked for


@dataclasses.dataclass
class _Tenant(Generic[T]):
    # Engines with queued fetches, in round-robin order (the next first).
    engines: collections.OrderedDict[str, collections.deque[_Queued[T]]] = dataclasses.field(
        default_factory=collections.OrderedDict)
    charged: int = 0             # bytes: queued charges + held blocks + answers not taken
    busy: bool = False           # a turn of it is running (at most one)


@dataclasses.dataclass
class _Turn(Generic[T]):
    queued: _Queued[T]
    held: bytes | None           # the engine's held block, when it is this job's


def _chunk_len(job: ReadJob[T]) -> int:
    return max(0, min(job.chunk, job.nbytes - job.offset))


class TierReader(Generic[T]):
    """The reads of one store (module docstring). The loop calls ``submit``,
    ``finished``, ``forget`` and ``close``; the threads take turns.

    Under ``_cond``, a charge belongs to a tenant in ``_tenants``: a tenant
    leaves the ring only with nothing charged, queued or running, so every
    byte charged is uncharged exactly once (turn ended, answer taken, held
    block let go)."""

    def __init__(self, store: BlockSource, *, threads: int = THREADS, tenant_bytes: int = MAX_TENANT_BYTES,
                 idle: float = IDLE, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.tenant_bytes = tenant_bytes
        self.idle = idle
        self.clock = clock
        self._cond = threading.Condition()
        # Under ``_cond``: tenants with anything charged, in round-robin order;
        # the turns running; the block held per (tenant, engine); the answers
        # for the loop, each with its tenant (charged until taken).
        self._tenants: collections.OrderedDict[int, _Tenant[T]] = collections.OrderedDict()
        self._running: list[_Turn[T]] = []
        self._held: dict[tuple[int, str], _Held] = {}
        self._done: collections.deque[tuple[int, ReadDone[T]]] = collections.deque()
        self._closing = False
        self.reads = 0               # blocks read from the store (each verified whole)
        # The loop polls this descriptor: a byte on it says an answer is waiting.
        self.wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._threads = [threading.Thread(target=self._run, name=f"kvelastic-tier-reader-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ the loop
    def submit(self, job: ReadJob[T]) -> str:
        """Queue a fetch: "" (its answer comes from ``finished``), or why it
        is refused (``REFUSALS``: nothing was queued or charged)."""
        with self._cond:
            tenant = self._tenants.get(job.tenant) or _Tenant()
            reads = self._reads_block(job, tenant)
            charge = _chunk_len(job) + (job.nbytes if reads else 0)
            if tenant.charged and tenant.charged + charge > self.tenant_bytes + (0 if reads else CONTINUE_SLACK):
                return "tenant_bytes"
            self._tenants.setdefault(job.tenant, tenant)
            tenant.charged += charge
            tenant.engines.setdefault(job.engine, collections.deque()).append(_Queued(job, charge))
            self._cond.notify()
        return ""

    def finished(self, limit: int = 1 << 30) -> list[ReadDone[T]]:
        """Up to ``limit`` answers, in the order their turns ended; with more
        waiting, the descriptor stays readable."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out: list[ReadDone[T]] = []
        with self._cond:
            while self._done and len(out) < limit:
                uid, done = self._done.popleft()
                self._uncharge(uid, len(done.data))
                out.append(done)
            more = bool(self._done)
        if more:
            self._wake()
        return out

    def forget(self, slots: Iterable[int]) -> None:
        """These slots' files are gone (freed, or dead: never served again):
        blocks held of them are let go, fetches of them queued are answered
        ``gone`` without reading, and one being read now is not held after."""
        gone = set(slots)
        if not gone:
            return
        with self._cond:
            for key, held in list(self._held.items()):
                if held.slot in gone:
                    self._drop_held(*key)
            queued = [q for t in self._tenants.values() for queue in t.engines.values() for q in queue]
            for q in [*queued, *(turn.queued for turn in self._running)]:
                q.gone = q.gone or q.job.slot in gone

    def charged(self, tenant: int) -> int:
        """Bytes charged to ``tenant`` now."""
        with self._cond:
            t = self._tenants.get(tenant)
            return t.charged if t is not None else 0

    def report(self) -> tuple[int, int]:
        """(fetches queued or being read, bytes charged to every tenant)."""
        with self._cond:
            queued = sum(len(q) for t in self._tenants.values() for q in t.engines.values())
            return queued + len(self._running), sum(t.charged for t in self._tenants.values())

    def close(self, timeout: float = 10.0) -> None:
        """Stop: turns running end, queued fetches are never answered (the
        daemon is stopping; its engines' leases end with it)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        os.close(self._wake_w)
        os.close(self.wake_fd)

    # ------------------------------------------------ bookkeeping (under ``_cond``)
    def _reads_block(self, job: ReadJob[T], tenant: _Tenant[T]) -> bool:
        """Whether ``job``'s turn will read its block: the block before it for
        its engine (its last queued fetch's, else its turn running's, else
        the one held) is another."""
        queue = tenant.engines.get(job.engine)
        if queue:
            return queue[-1].job.slot != job.slot
        for turn in self._running:
            if (turn.queued.job.tenant, turn.queued.job.engine) == (job.tenant, job.engine):
                return turn.queued.job.slot != job.slot
        held = self._held.get((job.tenant, job.engine))
        return held is None or held.slot != job.slot

    def _take(self) -> _Turn[T] | None:
        """The next turn: the first tenant in round-robin order with a fetch
        queued and no turn running, its next engine (which goes to the back
        of the tenant's ring), that engine's oldest fetch."""
        if self._closing:
            return None
        now = self.clock()
        self._expire(now)
        for uid, tenant in self._tenants.items():
            if tenant.busy or not tenant.engines:
                continue
            engine, queue = next(iter(tenant.engines.items()))
            queued = queue.popleft()
            if queue:
                tenant.engines.move_to_end(engine)
            else:
                del tenant.engines[engine]
            tenant.busy = True
            held = self._held.get((uid, engine))
            payload = None
            if held is not None and held.slot == queued.job.slot:
                held.used, payload = now, held.payload
            turn = _Turn(queued, payload)
            self._running.append(turn)
            return turn
        return None

    def _end(self, turn: _Turn[T], payload: bytes | None, done: ReadDone[T]) -> None:
        """A turn ended with ``done``; ``payload``: the block it read or served
        from (None: it failed, or was gone). The engine holds one block: the
        one it is reading chunk by chunk, until its last chunk."""
        self._running.remove(turn)
        job = turn.queued.job
        tenant = self._tenants[job.tenant]
        key = (job.tenant, job.engine)
        held = self._held.get(key)
        if turn.held is None and payload is not None:
            self.reads += 1
            if not done.finished and not turn.queued.gone:     # its next chunks come from memory
                self._drop_held(*key)
                self._held[key] = _Held(job.slot, payload, self.clock())
                tenant.charged += len(payload)
        elif held is not None and held.slot == job.slot and (done.finished or payload is None):
            self._drop_held(*key)
        tenant.busy = False
        self._tenants.move_to_end(job.tenant)      # its turn is over: after every tenant waiting, new ones too
        tenant.charged += len(done.data) - turn.queued.charge
        self._done.append((job.tenant, done))
        self._leave_if_empty(job.tenant)

    def _drop_held(self, uid: int, engine: str) -> None:
        held = self._held.pop((uid, engine), None)
        if held is not None:
            self._uncharge(uid, len(held.payload))

    def _uncharge(self, uid: int, nbytes: int) -> None:
        if not nbytes:
            return      # nothing charged (an empty answer): its tenant may have left the ring
        self._tenants[uid].charged -= nbytes
        self._leave_if_empty(uid)

    def _leave_if_empty(self, uid: int) -> None:
        tenant = self._tenants[uid]
        if not tenant.charged and not tenant.engines and not tenant.busy:
            del self._tenants[uid]           # nothing of it left here: out of the ring

    def _expire(self, now: float) -> None:
        for key, held in list(self._held.items()):
            if now - held.used > self.idle:
                self._drop_held(*key)

    # ------------------------------------------------------------- the threads
    def _run(self) -> None:
        name_this_thread("kv-tier-read")
        while True:
            with self._cond:
                turn = self._take()
                while turn is None:
                    if self._closing:
                        return
                    self._cond.wait(self.idle)
                    turn = self._take()
            payload, done = self._serve(turn)      # the disk, outside the lock
            with self._cond:
                self._end(turn, payload, done)
                self._cond.notify()                # its tenant may take a turn again
            self._wake()

    @staticmethod
    def _serve_chunk(job: ReadJob[T], payload: bytes) -> ReadDone[T]:
        end = min(len(payload), job.offset + job.chunk)
        return ReadDone(job.ticket, len(payload), payload[job.offset:end], "", end >= len(payload))

    def _serve(self, turn: _Turn[T]) -> tuple[bytes | None, ReadDone[T]]:
        """One turn's work: the block (read and verified whole, unless held)
        and the job's chunk of it."""
        job = turn.queued.job
        if turn.queued.gone:
            return None, ReadDone(job.ticket, -1, b"", "gone", True)
        payload = turn.held
        if payload is None:
            try:
                payload = self.store.read(job.slot, job.namespace, job.key)
            except (TierReadError, OSError) as exc:
                reason = exc.reason if isinstance(exc, TierReadError) else "io"
                log.warning("tier: block %d of namespace %s not served: %s", job.slot, job.namespace, exc)
                return None, ReadDone(job.ticket, -1, b"", reason, True)
        return payload, self._serve_chunk(job, payload)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass     # the pipe is full (the loop wakes anyway), or closed (the loop is gone)
