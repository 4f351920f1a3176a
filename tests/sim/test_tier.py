"""The node's tier in the simulator (``kvelastic_tools.sim.tier``):
odd seeds run with a real ``TierIndex`` handed to the allocator; kept cache
released, and cached slabs reclaimed from running engines for another
namespace, are demoted into a simulated store that fills up and tears blocks;
engines look up and fetch on a miss, die holding leases and abandon them;
``kvelastic invalidate`` hits namespaces with tier blocks; a new daemon
rebuilds its index from the store. Engines are of two tenants (uids:
``World.cred_of``), whose pins, leases and staging are bounded per tenant:
no tenant pins past its share. The tier's invariants hold in every seed.

The second re-injects bugs, in the daemon and in the loop's part, and shows
the simulator catches each: blocks served after their namespace was
invalidated, leases that outlive their engine or their deadline,
invalidated kept cache demoted, a tenant's pins past its share, a live
loaded slot's bytes deleted while a
lease holds it, and a reclaimed slab's cache demoted though its namespace
was invalidated before it was unmapped (caught as KV of before the
invalidation demoted, or adopted by a replica: the simulator checks both),
and an invalidation that leaves a write of its namespace queued (the
audit's case, fixed in d3046d0: a stop that writes what is queued let the
next daemon restore the block; caught as a block of an invalidated scope
restored).

The tier's writer is the daemon's (``sim/tier_writer.py``): writes queued,
written later, reported at the loop's next pass; a delete cancels a write
queued; a graceful stop writes what is queued, a kill -9 loses it.
Invalidations come while writes of their namespace are in flight, followed
at once by a stop or a kill now and then, and no block of a namespace
invalidated (and answered) before a stop is restored by the next daemon.

The third and fourth replay the gaps it found, fixed: a block served after
its namespace was invalidated, by a lease granted before the invalidation
(seed 353), or restored by the next daemon from the file kept for a load
(seed 1147: the file of a block invalidated or dropped goes at once now,
even while a load pins it).

Demotion source B (``kvelastic.daemon.staging``): the engines of those seeds
honour ``Registered.tier``, so blocks they are about to evict are copied into
the daemon's staging, written once their next journal acknowledges the copy,
and discarded when the engine dropped them first (rewritten: the sim's
per-block KV shows such a copy torn) or never confirmed them. Those tests
check that it happens, that the copies the daemon writes are whole, and that
the simulator catches the ack rule, the discard at departure and the copy
deadline taken away. Three replays are of gaps it found in source B, fixed
since (``ClearIndex.scope``, tickets reset at registration): seeds 2053, 1111
and 1737 as they failed then; the simulator changed with the fix (its engines
carry ``Journal.scope`` as the client does), so they replay the same seeds,
not the same runs, and the checks that caught them stay."""

import pytest

from kvelastic.daemon.handoff import CacheHandoff
from kvelastic.daemon.invalidation import CacheScope
from kvelastic.daemon.staging import Staging
from kvelastic.daemon.state import EngineRecord, Way
from kvelastic.daemon.tiering import Tiering
from kvelastic.tier.books import TierBooks
from kvelastic.tier.index import TierIndex
from kvelastic.tier.pins import PinBooks
from kvelastic_tools.sim import tier as sim_tier
from kvelastic_tools.sim.run import run_seed

SEEDS = range(1, 400, 2)       # the seeds with a tier
STEPS = 300


def run_seeds(seeds) -> dict[str, int]:
    """Every seed of ``seeds`` with no violation (else the first five, with
    their replays); the faults and events they counted, summed."""
    faults: dict[str, int] = {}
    failures = []
    for seed in seeds:
        result = run_seed(seed, STEPS)
        for kind, n in result.faults.items():
            faults[kind] = faults.get(kind, 0) + n
        if result.violations:
            failures.append(f"{result.violations[0]}  (replay: {result.replay})")
    assert not failures, f"{len(failures)} seed(s) failed:\n" + "\n".join(failures[:5])
    return faults


# The writer's: invalidations with writes of their namespace in flight, and
# stops and kills -9 with writes in flight, of a namespace invalidated since
# among them; writes cancelled in the queue, files written but not reported
# deleted, written at a graceful stop, lost at a kill.
WRITER_KINDS = ("tier_invalidated_with_writes_queued", "tier_stop_with_writes_queued", "tier_crash_with_writes_queued",
                "tier_stop_with_invalidated_writes", "tier_crash_with_invalidated_writes",
                "tier_write_cancelled_queued", "tier_write_cancelled", "tier_written_deleted_unreported",
                "tier_written_at_stop", "tier_lost_at_kill", "tier_disk_stalled")


def test_the_tier_in_the_simulator_holds_its_invariants():
    """No violation, a block of an invalidated scope restored by the next
    daemon included; and what the writer model is for happens."""
    faults = run_seeds(SEEDS)
    for kind in ("tier_demoted", "tier_demoted_reclaimed", "tier_promoted", "tier_disk_full", "tier_torn",
                 "lease_engine_died", "lease_expired", "tier_invalidated", "tier_released", "tier_rebuilt",
                 *WRITER_KINDS):
        assert faults.get(kind, 0) > 0, f"no {kind} in {len(SEEDS)} seeds"
    assert not faults.get("tier_invalidated_restored")


def test_even_seeds_run_without_a_tier():
    result = run_seed(2, 100)
    assert not any(kind.startswith("tier_") for kind in result.faults)


def invalidate_forgets_the_tier(monkeypatch):
    """``TierIndex.invalidate`` leaves every entry where it was."""
    monkeypatch.setattr(TierIndex, "invalidate", lambda self, namespace: 0)


def leases_outlive_engines(monkeypatch):
    """An engine's leases do not end with it."""
    monkeypatch.setattr(Tiering, "end_for", lambda self, engine: None)


def leases_never_expire(monkeypatch):
    """A lease nobody releases is never ended at its deadline."""
    monkeypatch.setattr(Tiering, "expire", lambda self: None)


def invalidated_kept_cache_demoted(monkeypatch):
    """Kept cache released by an invalidation is demoted like expired cache."""
    release = CacheHandoff.release

    def demote_too(self, slabs, why, reason):
        if reason == "invalidate" and self.tiering is not None:
            self.tiering.demote(slabs)
        release(self, slabs, why, reason)
    monkeypatch.setattr(CacheHandoff, "release", demote_too)


def files_of_loaded_blocks_handed_out(monkeypatch):
    """The index hands out the files of the blocks a lookup pins (live ones)."""
    pin = TierIndex.pin      # what ``lookup`` and the daemon's leases call

    def hand_out(self, namespace, keys, now, **kw):
        slots, cut = pin(self, namespace, keys, now, **kw)
        self._released.extend(slots)
        return slots, cut
    monkeypatch.setattr(TierIndex, "pin", hand_out)
    monkeypatch.setattr(TierIndex, "check", lambda self: None)    # the index's own check would see it first


def invalidation_leaves_writes_queued(monkeypatch):
    """``TierBooks._kill`` as before d3046d0: a dead entry's bytes go at once
    only when committed; a pending one's write stays queued (its file goes
    at its commit), so a stop that writes what is queued, or a kill after
    the write, leaves a file the next daemon restores."""
    def kill(self, e):
        e.dead, e.heap_seq = True, -1
        if e.committed and not e.gone:
            e.gone = True
            self._released.append(e.slot)
    monkeypatch.setattr(TierBooks, "_kill", kill)
    monkeypatch.setattr(TierIndex, "check", lambda self: None)    # the index's own check would see it first


def pins_past_the_share(monkeypatch):
    """A tenant's lookups pin whatever they find (``PinBooks.fits`` as
    before per-tenant shares): one tenant could pin the whole tier."""
    monkeypatch.setattr(PinBooks, "fits", lambda self, tenant, budget, taken, taking, nbytes: True)


def reclaimed_cache_survives_invalidation(monkeypatch):
    """What a reclaim noted for the tier is not cleared by an invalidation of
    the engine's namespace (as if kept anywhere but ``slab.route``), and the
    reclaim's answer is not checked against the invalidation either (the
    engine's ``scope_changes`` left as they were): both defences gone."""
    forget = CacheScope._forget_handoffs

    def keep_tier_notes(self, engine):
        notes = [(slab, slab.route) for other in (*self.books.engines.values(), *self.books.departing.values())
                 for slab in other.slabs.values() if slab.route.way in (Way.NOTED, Way.TIER)]
        forget(self, engine)
        engine.scope_changes -= 1
        for slab, route in notes:
            slab.route = route      # the fault: the routes' one writer bypassed
    monkeypatch.setattr(CacheScope, "_forget_handoffs", keep_tier_notes)


def caught(name: str, found: str | tuple[str, ...]) -> None:
    """A seed among the first 400 tier seeds reports the re-injected fault
    ``name``, first, as ``found`` (or one of them)."""
    for seed in range(1, 800, 2):
        result = run_seed(seed, STEPS)
        if result.violations:
            print(f"{name}: caught by seed {seed}: {result.violations[0]}")
            assert any(f in result.violations[0] for f in ((found,) if isinstance(found, str) else found)), \
                result.violations
            return
    pytest.fail(f"{name} was not caught in 400 seeds")


@pytest.mark.parametrize(("fault", "found"), [(invalidate_forgets_the_tier, ("served after its namespace",
                                                                                "of an invalidated scope restored")),
                                              (leases_outlive_engines, "outlived its engine"),
                                              (leases_never_expire, "outlived its deadline"),
                                              (invalidated_kept_cache_demoted, "demoted"),
                                              (files_of_loaded_blocks_handed_out, "deleted while"),
                                              (reclaimed_cache_survives_invalidation, "invalidated"),
                                              (invalidation_leaves_writes_queued,
                                               "of an invalidated scope restored"),
                                              (pins_past_the_share, "past its share")])
def test_the_simulator_catches_a_tier_bug(fault, found, monkeypatch):
    fault(monkeypatch)
    caught(fault.__name__, found)


def test_the_audits_case_is_caught_after_a_graceful_stop_and_after_a_kill(monkeypatch):
    """The bug d3046d0 fixed, re-injected: in 50 seeds, a block of a
    namespace invalidated while its write was in flight is restored by the
    next daemon, after a graceful stop (its writer wrote what was queued)
    and after a kill -9 (the write ended before the loop heard of it)."""
    invalidation_leaves_writes_queued(monkeypatch)
    found = {"graceful stop": 0, "kill -9": 0}
    for seed in range(1, 101, 2):
        result = run_seed(seed, STEPS)
        for how in found:
            found[how] += any("invalidated scope restored" in v and f"after a {how}" in v for v in result.violations)
    assert all(found.values()), found


@pytest.mark.parametrize("seed", [9783, 12673])
def test_a_clear_deferred_across_a_restart_lends_the_next_daemon_no_scope(seed):
    """Seed 9783: ns0 invalidated (ClearIndex scope 2), the daemon killed at
    once; e0 had deferred the clear, and runs it after the new daemon's
    handshake (``_run_or_defer``: before ``resend_index``), which raises its
    scope to 2 past the new daemon's 0 (``_clear_index``: max). The new
    daemon invalidates ns0 twice; at its second ``ClearIndex`` (scope 2),
    e0's journals already say scope 2: its keys count as current before it
    cleared them, and its slabs are kept with KV of before the invalidation
    when it dies. Seed 12673 the same with no slab held (the clear runs at
    the next poll, after the handshake all the same). Found at 10,000 seeds
    with the writer model; fixed: a clear of an earlier connection leaves
    the scope alone (``_clear_index``'s ``registration``)."""
    result = run_seed(seed, STEPS)
    assert not result.violations, result.violations


def test_a_lease_granted_before_an_invalidation_serves_none_of_its_blocks_after_it():
    """Seed 353 found it: the lease's pinned entries were dead, yet fetches
    read them. (Replayed as found: engines that do not demote.)"""
    result = run_seed(353, STEPS, evictions=False)
    assert not result.violations, result.violations


def test_no_block_invalidated_under_a_load_comes_back_after_a_restart():
    """Seed 1147 found it: a block invalidated while a load held it kept its
    file until the load ended, and a daemon restarted meanwhile restored it
    live. Its file goes at the invalidation now (never served again).
    (Replayed as found: engines that do not demote.)"""
    result = run_seed(1147, STEPS, evictions=False)
    assert not result.violations, result.violations


# ---------------------------------------------------------------- source B
B_SEEDS = range(401, 521, 2)    # 60 seeds with a tier, beside SEEDS: about 2 s


def test_source_b_copies_running_engines_evictions_and_writes_only_whole_ones():
    """Blocks running engines were about to evict are staged, written and
    committed, loaded back by engines; some are discarded because the engine
    dropped them before its ack (some of those were torn: rewritten before
    the copy), some because it never confirmed them (it died, resynced, ran
    out the deadline); a copy's read fails now and then; invalidations reach
    the engines (``ClearIndex``). No violation: every copy written was whole."""
    faults = run_seeds(B_SEEDS)
    for kind in ("tier_staged", "tier_copied_heard", "tier_staged_written", "tier_staged_committed",
                 "tier_staged_raced", "tier_staged_torn", "tier_staged_torn_dropped", "tier_staged_unconfirmed",
                 "tier_staged_read_failed", "tier_promoted_evicted", "clear_index"):
        assert faults.get(kind, 0) > 0, f"no {kind} in {len(B_SEEDS)} seeds"
    assert faults["tier_staged_written"] < faults["tier_staged"]


def test_engines_that_ignore_the_tier_flag_demote_nothing():
    result = run_seed(3, STEPS, evictions=False)
    assert not any(kind.startswith("tier_staged") for kind in result.faults), result.faults


def no_ack_rule(monkeypatch):
    """A copy's block dropped before the ack does not make it raced."""
    monkeypatch.setattr(Staging, "_race", lambda self, slots: None)


def acks_ignored(monkeypatch):
    """Every pending copy is confirmed by the engine's next journal, whatever ticket it carries."""
    settle = Staging._settle
    monkeypatch.setattr(Staging, "_settle", lambda self, serial, ack: settle(self, serial, 1 << 62))


def copies_outlive_engines(monkeypatch):
    """An engine's pending copies do not end with it."""
    monkeypatch.setattr(Staging, "end_for", lambda self, engine: None)


def copies_never_expire(monkeypatch):
    """A copy never acknowledged waits for ever (found sooner with a shorter deadline)."""
    monkeypatch.setattr(Staging, "expire", lambda self: None)
    monkeypatch.setattr(sim_tier, "COPY_TIMEOUT", 0.3)


def clears_not_awaited(monkeypatch):
    """The daemon trusts an engine's keys as soon as it told it to clear them
    (as before ``ClearIndex.scope``): kept, copied and handed on at once."""
    monkeypatch.setattr(EngineRecord, "keys_current", property(lambda self: True))


@pytest.mark.parametrize(("fault", "found"), [(no_ack_rule, "written from a staged copy"),
                                              (clears_not_awaited, "before its namespace was invalidated"),
                                              (acks_ignored, "written from a staged copy"),
                                              (copies_outlive_engines, "outlived its engine's registration"),
                                              (copies_never_expire, "outlived its deadline")])
def test_the_simulator_catches_a_source_b_bug(fault, found, monkeypatch):
    fault(monkeypatch)
    caught(fault.__name__, found)


def test_an_ack_kept_from_the_daemon_before_confirms_no_copy():
    """Seed 2053 found it: the engine heard ticket 1 from a daemon that then
    restarted; re-registered, it kept ``tier_ack`` 1, so the new daemon's copy
    of ticket 1 was confirmed by a journal taken before the engine evicted
    and rewrote the block, whose REMOVE came in the next one: a torn copy
    written to the tier. A registration resets the ticket now."""
    result = run_seed(2053, STEPS)
    assert not result.violations, result.violations


def test_a_deferred_clear_index_is_not_overtaken_by_an_ack():
    """Seed 1111 found it: the daemon invalidated ns0, then copied blocks e0 demoted in
    a journal taken before it heard the ClearIndex (ticket 3). e0 deferred
    the ClearIndex (``EngineClient._run_or_defer``: the scheduler held the
    lock) but recorded the ticket at once (``_on_command``), and a flush of
    the scheduler's (``ensure``, ``seal_step``: no ``_run_deferred``) acked
    it before the CLEAR went: KV of before the invalidation written to the
    tier as live. The daemon copies nothing of an engine now until its
    journal says it applied the ClearIndex (``Journal.scope``)."""
    result = run_seed(1111, STEPS)
    assert not result.violations, result.violations


def test_kept_cache_of_an_engine_killed_before_its_clear_index_is_not_demoted():
    """Seed 1737 found it: e1 was told to clear its index (its namespace
    invalidated) and was killed before it did; the daemon kept its slabs
    with the keys of before the invalidation, e1's next process adopted them
    (a warm start) and demoted them: the daemon wrote them to the tier. Such
    an engine's cache is kept by no one now, and the simulator checks that
    none of that KV is adopted or demoted by any path."""
    result = run_seed(1737, STEPS)
    assert not result.violations, result.violations
