"""Hostile clients: registrations with huge or odd but type-valid geometry,
and journals, grows and acknowledgements that name what the sender does not
hold (in the name of a hostile engine, or of a registered sim engine on its
own connection).

Every message goes through the wire format first (what does not decode is
refused by the loop: fine). Then each must be refused with a typed ``Error``
(a ``Reason``) and leave every book exactly as it was, or be accepted within
bounds: a registration's blocks fit in its slab, a slab and the engine's
capacity in the budget, its workers within the protocol's limit; a journal
leaves keys only in slabs the engine holds. No call may do work out of
proportion to its input (``guard.py``): while a hostile engine is on the
books a CPU watchdog interrupts any call past the limit, so a walk over
2**40 block ids is reported, not waited for.

An accepted hostile engine stays on the books for a moment (grows, ticks and
other engines' reclaims see it), then unregisters or closes its lifeline.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.growth import MAX_GROW
from kvelastic.daemon.state import EngineRecord, Phase
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE
from kvelastic_tools.sim.records import BUSY

if TYPE_CHECKING:
    from kvelastic.daemon.allocator import Allocator
    from kvelastic_tools.sim.engine import SimEngine
    from kvelastic_tools.sim.guard import CallGuard

NAMESPACE = "hostile"        # its own: nothing it keeps reaches another namespace's engines
HUGE = (1 << 31, 1 << 40, 1 << 62, (1 << 63) - 1)
BOUNDED = (1 << 12, 1 << 16)          # without a watchdog (not the main thread): walks stay short
REASONS = {r.value for r in p.Reason}


@dataclasses.dataclass(eq=False)
class Hostile:
    engine_id: str
    identity: bytes
    token: bytes
    leave_at: float


class HostileWorld(Protocol):
    """What a hostile client uses of the world (``World`` fits it; the world
    drives the hostile clients, so this module does not import it): the
    allocator it talks to, the watchdog over each call (``guard.py``), the
    sim engines whose connections it borrows, and its own books."""

    hostile_req: int          # the last hostile request's number

    @property
    def now(self) -> float: ...

    @property
    def rng(self) -> random.Random: ...

    @property
    def counts(self) -> collections.Counter[str]: ...

    @property
    def allocator(self) -> Allocator: ...

    @property
    def guard(self) -> CallGuard: ...

    @property
    def engines(self) -> Sequence[SimEngine]: ...

    @property
    def hostiles(self) -> list[Hostile]: ...

    @property
    def budget_pages(self) -> int: ...

    def call(self, fn: Any, *args: Any) -> list[fx.Effect]: ...

    def perform(self, effects: list[fx.Effect]) -> None: ...

    def close_peer_of(self, engine_id: str, rank: int, token: bytes = b"") -> None: ...

    def violation(self, what: str) -> None: ...


def act(w: HostileWorld, rng: random.Random) -> None:
    """One hostile fault: a hostile registration (half the time), else
    hostile messages from a registered sim engine's own connection."""
    w.guard.watch = True
    try:
        engines = [e for e in w.engines if e.alive and e.registered and not e.dying
                   and _record(w.allocator, e.name, e.identity) is not None]
        if engines and rng.random() < 0.5:
            engine = rng.choice(engines)
            w.counts["hostile_journal"] += 1
            record = _record(w.allocator, engine.name, engine.identity)
            if record is not None:
                for msg in _journals(rng, w, record):
                    send(w, engine.identity, msg)
        else:
            w.counts["hostile_registration"] += 1
            register(w, rng)
    finally:
        w.guard.watch = bool(w.hostiles)


def register(w: HostileWorld, rng: random.Random) -> None:
    n = w.counts["hostile_registration"]
    engine_id, token = f"h{n}", rng.randbytes(16)
    identity = f"H:{n}".encode()
    fields = _geometry(rng, w)
    if "engine_id" in fields:               # a registered engine's id, without its secret
        engine_id = fields.pop("engine_id")
    msg = p.RegisterEngine(**{**dict(version=p.PROTOCOL_VERSION, engine_id=engine_id, pid=9000 + n,
                                     namespace=NAMESPACE, page_size=PAGE, pages_per_worker=1, num_workers=0,
                                     blocks_per_slab=4, block_bytes=PAGE // 4, token=token), **fields})
    w.perform(w.call(w.allocator.peer_opened, engine_id, -1, w.now, token))     # its lifeline, as a client's
    reply = send(w, identity, msg)
    record = w.allocator.engines.get(engine_id)
    if not isinstance(reply, p.Registered) or record is None or record.identity != identity:
        w.close_peer_of(engine_id, -1, token)
        return
    w.counts["hostile_accepted"] += 1
    check_geometry(w, record)
    hostile = Hostile(engine_id, identity, token, w.now + rng.uniform(0.0, 1.0))
    w.hostiles.append(hostile)
    send(w, identity, p.Grow(engine_id=engine_id, slabs=rng.choice((1, 2, MAX_GROW, *_huge(w))),
                             demand=rng.random() < 0.5))
    for journal in _journals(rng, w, record):
        send(w, identity, journal)
    x = _foreign_slab(rng, w, record)
    huge = rng.choice(_huge(w))
    hostile_msgs: tuple[p.Msg, ...] = (
        p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=engine_id, rank=huge, pid=1, mapped=[huge], token=token),
        p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id=engine_id, rank=0, pid=1, token=b"x" * 16),
        p.Mapped(engine_id=engine_id, rank=huge, slab=x), p.Unmapped(engine_id=engine_id, rank=0, slab=x),
        p.Return(engine_id=engine_id, slabs=[x, huge]),
        p.ReclaimDone(req_id=huge, engine_id=engine_id, given=[x], refused=[], cached={}))
    for other in hostile_msgs:
        send(w, identity, other)
    victims = [e for e in w.engines if e.alive and e.registered]
    if BUSY is not None and victims:         # another engine's unmaps, in its name: nothing may move
        victim = rng.choice(victims)
        send(w, identity, BUSY(engine_id=victim.name, rank=0, slabs=victim.pool.slab_ids() + [x]),
             must_not_change=True)


def tend(w: HostileWorld, every: bool = False) -> None:
    """Hostile engines whose moment is over leave: an Unregister, or their lifeline closes."""
    for hostile in [h for h in w.hostiles if every or w.now >= h.leave_at]:
        w.hostiles.remove(hostile)
        w.guard.watch = True
        if w.rng.random() < 0.5:
            send(w, hostile.identity, p.Unregister(engine_id=hostile.engine_id))
        w.close_peer_of(hostile.engine_id, -1, hostile.token)
        w.guard.watch = bool(w.hostiles)


# ------------------------------------------------------------------ messages
def send(w: HostileWorld, identity: bytes, msg: p.Msg, must_not_change: bool = False) -> p.Msg | None:
    """``msg`` as the loop hands it over (encoded, decoded), then the verdict:
    a refusal is a typed Error and changes no book. Returns the reply."""
    w.hostile_req += 1
    msg.req_id = (1 << 40) + w.hostile_req     # never one of a sim engine's own requests
    try:
        frame = p.encode(msg)
        decoded = p.decode(frame)
    except (msgspec.DecodeError, OverflowError, ValueError):
        w.counts["hostile_undecodable"] += 1     # the loop refuses it (malformed): nothing reaches the books
        return None
    if len(frame) > p.MAX_MESSAGE_BYTES:
        return None
    before = books(w.allocator)
    record = w.allocator.engines.get(getattr(decoded, "engine_id", ""))
    keyed = set(record.mirror.key_of) if record is not None and isinstance(decoded, p.Journal) else None
    effects = w.call(w.allocator.handle, identity, decoded, w.now)
    reply = next((e.msg for e in effects if isinstance(e, fx.Send) and e.to == identity
                  and e.msg.req_id == msg.req_id), None)
    what = f"hostile {type(msg).__name__} ({_brief(msg)})"
    if isinstance(reply, p.Error):
        w.counts["hostile_refused"] += 1
        if reply.reason not in REASONS or not any(isinstance(e, fx.Rejected) for e in effects):
            w.violation(f"{what}: refused without a typed reason ({reply.reason!r})")
        changed = _changed(before, books(w.allocator))
        if changed:
            w.violation(f"{what}: refused ({reply.reason}), but the books changed: {changed}")
    elif must_not_change:
        changed = _changed(before, books(w.allocator))
        if changed:
            w.violation(f"{what}: from a connection that does not own it, yet the books changed: {changed}")
    elif record is not None and keyed is not None:
        check_journal(w, record, keyed)          # accepted: within bounds?
    # The hostile sender takes its own replies (not the sim engine whose connection it used).
    w.perform([e for e in effects if not (isinstance(e, fx.Send) and e.to == identity and e.msg is reply)])
    return reply


def _brief(msg: p.Msg) -> str:
    fields = [f"{k}={v!r}"[:48] for k, v in msgspec.structs.asdict(msg).items()
              if k not in ("req_id", "token", "version", "pid", "namespace")]
    return ", ".join(fields)[:240]


def check_geometry(w: HostileWorld, r: EngineRecord) -> None:
    """An accepted registration is within bounds: nothing it declared is more than its memory could be."""
    alloc = w.allocator
    budget = alloc.pools[r.device].budget_pages
    slab_pages = r.pages_per_worker * max(1, r.num_workers)
    problems = []
    if r.blocks_per_slab * r.block_bytes > slab_pages * alloc.page_size:
        problems.append(f"{r.blocks_per_slab} blocks of {r.block_bytes} bytes do not fit in its slab of "
                        f"{slab_pages} page(s)")
    if slab_pages > budget or r.max_slabs * slab_pages > budget:
        problems.append(f"{r.max_slabs} slab(s) of {slab_pages} page(s) exceed the budget of {budget}")
    if r.min_bytes > budget * alloc.page_size:
        problems.append(f"min_bytes {r.min_bytes} exceeds the budget")
    max_workers = getattr(p, "MAX_WORKERS", None)
    if max_workers is not None and r.num_workers > max_workers:
        problems.append(f"{r.num_workers} workers, more than {max_workers}")
    if problems:
        w.violation(f"hostile registration of {r.engine_id} accepted out of bounds: {'; '.join(problems)}")


def check_journal(w: HostileWorld, r: EngineRecord, keyed_before: set[int]) -> None:
    """An accepted journal leaves keys only in slabs the engine holds."""
    outside = [b for b in set(r.mirror.key_of) - keyed_before if b // r.blocks_per_slab not in r.slabs]
    if outside:
        w.violation(f"engine {r.engine_id}: a journal left keys in block(s) {sorted(outside)[:3]}, in slab(s) it "
                    f"does not hold")
    extra = [s for s in r.mirror.slabs if s not in r.slabs or r.slabs[s].phase is not Phase.HELD]
    if extra:
        w.violation(f"engine {r.engine_id}: a journal put slab(s) {sorted(extra)[:3]} it does not hold in the mirror")


def _journals(rng: random.Random, w: HostileWorld, r: EngineRecord) -> list[p.Msg]:
    """Journals naming a slab ``r`` does not hold (for a hostile engine, also absurd step numbers)."""
    x = _foreign_slab(rng, w, r)
    bps = r.blocks_per_slab
    block = min(x * bps + rng.randrange(min(bps, 1 << 20)), (1 << 63) - 1)
    key = f"{r.namespace}:forged:{x}".encode()
    options: list[tuple[list[Any], dict[int, tuple[int, int, int]]]] = [
        ([p.AddSlab(slab=x), p.StoreKey(key=key, block=block)], {}),
        ([p.StoreKey(key=key, block=block)], {}),
        ([p.AddSlab(slab=x)], {x: (0, 0, bps)}),
        ([p.AddSlab(slab=x), p.RemoveSlab(slab=x), p.RemoveKey(key=key, block=block)], {}),
        ([p.AddSlab(slab=s) for s in {rng.randrange(1 << 40) for _ in range(rng.choice((10, 200)))}], {}),
    ]
    if r.namespace == NAMESPACE:
        options.append(([p.StepBegun(step=rng.choice(_huge(w))), p.StepDone(step=rng.choice(_huge(w)))], {}))
    return [p.Journal(engine_id=r.engine_id, ops=ops, occupancy=occupancy) for ops, occupancy in rng.sample(options, 2)]


def _record(alloc: Allocator, engine_id: str, identity: bytes) -> EngineRecord | None:
    record = alloc.engines.get(engine_id)
    return record if record is not None and record.identity == identity and not record.failed else None


def _foreign_slab(rng: random.Random, w: HostileWorld, r: EngineRecord) -> int:
    """A slab id ``r`` does not hold: past its range, far away, or a free place in it."""
    free = [s for s in range(min(r.max_slabs, 64)) if s not in r.slabs]
    far = min(rng.choice(_huge(w)), ((1 << 63) - 1) // max(1, r.blocks_per_slab) - 1)
    return rng.choice([r.max_slabs + rng.randrange(8), far, *(free[:1] or [r.max_slabs])])


def _huge(w: HostileWorld) -> tuple[int, ...]:
    return HUGE if w.guard.available else BOUNDED


def _geometry(rng: random.Random, w: HostileWorld) -> dict[str, Any]:
    """One or two hostile changes to a plain registration (no workers, one page per slab)."""
    budget = w.budget_pages
    huge = rng.choice(_huge(w))
    choices: list[dict[str, Any]] = [
        dict(blocks_per_slab=1 << 40 if w.guard.available else huge, block_bytes=1),
        dict(blocks_per_slab=huge, block_bytes=rng.choice((1, PAGE, huge))),
        dict(blocks_per_slab=PAGE, block_bytes=1),                     # fits: 2 Mi blocks of one byte
        dict(pages_per_worker=budget, blocks_per_slab=budget * PAGE, block_bytes=1),   # fits, whole budget
        dict(block_bytes=huge),
        dict(pages_per_worker=huge),
        dict(pages_per_worker=budget + 1),
        dict(num_workers=huge),
        dict(num_workers=budget),                                       # fits; its workers never come
        dict(min_bytes=huge),
        dict(min_bytes=budget * PAGE),
        dict(max_bytes=1),
        dict(max_bytes=huge),
        dict(min_bytes=2 * PAGE, max_bytes=PAGE),
        dict(block_tokens=huge),
        dict(held=[huge]),
        dict(held=[0, 0]),
        dict(held=list(range(budget + 1))),
        dict(held=[0], occupancy={0: (huge, 0, 0)}),
        dict(page_size=huge),
        dict(device="nowhere"),
        dict(version=huge),
    ]
    live = [e.name for e in w.engines if _record(w.allocator, e.name, e.identity) is not None]
    if live:
        choices.append(dict(engine_id=rng.choice(live)))            # someone else's id, without its secret
    fields: dict[str, Any] = {}
    for change in rng.sample(choices, rng.choice((1, 1, 2))):
        fields.update(change)
    return fields


# ------------------------------------------------------------------- books
def books(alloc: Allocator) -> tuple[Any, ...]:
    """Everything the allocator keeps that a message could change."""
    return (
        tuple((name, pool.budget_pages, pool.created, pool.creating, pool.adopted, tuple(pool.free.items()))
              for name, pool in alloc.pools.items()),
        tuple((key, _record_books(e)) for key, e in alloc.engines.items()),
        tuple(_record_books(e) for e in alloc.departing.values()),
        tuple((o.namespace, tuple(o.pages), o.cached) for o in alloc.orphans),
        tuple((seq, r.engine_id, r.wanted, tuple(r.slabs), tuple(sorted(r.mapping)), r.deadline)
              for seq, r in alloc.grows.items()),
        tuple(sorted(alloc.reclaims)),
        tuple(alloc.returns),
        tuple((key, tuple(sorted(tokens.items()))) for key, tokens in alloc.channels.items()),
    )


BOOKS = ("device pools", "engines", "departing engines", "kept cache", "grows", "reclaims", "returns", "peers")


def _record_books(e: EngineRecord) -> tuple[Any, ...]:
    m = e.mirror
    return (e.engine_id, e.identity, e.token, e.failed, e.namespace, e.min_bytes, e.max_bytes, e.max_slabs,
            e.blocks_per_slab, e.block_bytes, e.num_workers, e.pages_per_worker, e.pending_grows,
            tuple(sorted(e.workers.items())),
            tuple((sid, s.phase, tuple(s.pages), tuple(sorted(s.waiting)), s.deadline, s.orphan)
                  for sid, s in e.slabs.items()),
            tuple(sorted(m.slabs.items())), tuple(sorted(m.key_of.items())), m.step, m.done,
            tuple(sorted(e.stats.items())))


def _changed(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    return ", ".join(name for name, b, a in zip(BOOKS, before, after) if b != a)
