"""Ghosts: workers of an engine's earlier registration whose processes have
not exited yet, while the engine id is registered again.

An engine's process is killed, but its workers hang on: one stuck in the
driver answers nothing (frozen), another is inside a model step that
outlives its engine and unmaps only once the step ends, saying so (``Busy``)
meanwhile. They keep their connections, page channels (showing the old
secret) and mappings until they exit. Meanwhile the engine comes back under
the same id: a new registration with a new secret, which may itself depart
while the old one still waits for its ghosts. The daemon must keep both
records (``Allocator.departing``), take each ghost's acknowledgement and
channel for its own registration only, and lose no page.

This module is how ghosts behave. Their record (``records.Ghost``) is named
by the world and the engines too, so it lives below them all, and a ghost
sees the world through ``ports.WorkerWorld`` as an engine's worker does.
"""

from __future__ import annotations

from kvelastic import protocol as p
from kvelastic_tools.sim.ports import WorkerWorld
from kvelastic_tools.sim.records import BUSY, Ghost


def on_message(world: WorkerWorld, ghost: Ghost, msg: p.Msg) -> None:
    """A command reaches the ghost's I/O thread (a frozen one gets nothing)."""
    w = ghost.worker
    if isinstance(msg, p.MapSlab):             # sent before its engine died: mapped at once, as ever
        pages = [page for page, _offset in msg.pages]
        for page in pages:
            if page in w.channel:
                w.channel.remove(page)
        w.mapped[msg.slab] = pages
        world.dirty = True
        world.client_send(w.identity, p.Mapped(req_id=msg.req_id, engine_id=ghost.engine_id, rank=w.rank,
                                               slab=msg.slab))
    elif isinstance(msg, p.UnmapSlab):
        if ghost.stepping(world.now):
            w.defer(msg, world.now)
        else:
            unmap(world, ghost, msg)


def unmap(world: WorkerWorld, ghost: Ghost, msg: p.UnmapSlab) -> None:
    w = ghost.worker
    w.mapped.pop(msg.slab, None)
    world.client_send(w.identity, p.Unmapped(req_id=msg.req_id, engine_id=ghost.engine_id, rank=w.rank,
                                             slab=msg.slab))


def tend(world: WorkerWorld) -> None:
    """Each step: a ghost whose step ended unmaps what waited for it; one in
    its step says Busy (every quarter of the ack deadline); one whose time
    came exits (its connections close, its mappings go with it)."""
    now = world.now
    for ghost in list(world.ghosts.values()):
        w = ghost.worker
        if now >= ghost.exit_at:
            leave(world, ghost)
        elif ghost.frozen:
            continue
        elif w.deferred and not ghost.stepping(now):
            deferred, w.deferred = w.deferred, []
            for msg in deferred:
                unmap(world, ghost, msg)
        elif w.deferred and BUSY is not None and now - w.busy_at >= w.ack_timeout / 4:
            w.busy_at = now
            world.send_busy(ghost.engine_id, w)
            world.counts["busy_ghost"] += 1


def leave(world: WorkerWorld, ghost: Ghost) -> None:
    """The ghost's process exits: mappings first, then its sockets close."""
    w = ghost.worker
    world.ghosts.pop(w.identity, None)
    w.mapped.clear()
    w.channel.clear()
    w.deferred = []
    if w.identity in world.wires:
        world.close(w.identity)
        world.close_peer_of(ghost.engine_id, w.rank, w.token)
