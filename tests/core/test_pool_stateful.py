"""Random sequences of every pool operation, checked against a plain model.

The model keeps refcounts, keys and the LRU order in dicts and lists. Where
the pool may choose (which free block best fit hands out, how many extra
blocks page-aware eviction takes), the test checks the choice against the
rules and then applies it to the model. After every step: the invariants of
``check_pool`` (refcount sync, one state per block, index both ways, cache
limit, journal replay == pool state, demoted blocks included) and model ==
pool; the journal's step marks give the mirror exactly the valid keys: those
stored while no step was open, or in a step that has ended, and not
demoted; and the seal's rule: unless the journal says a key was dropped,
every key whose KV the daemon's mirror would keep is still its block's in the pool.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvelastic.core.block import Block
from kvelastic.core.journal import Mirror
from kvelastic.core.pool import SlabPool
from kvelastic.errors import PoolError
from tests.core.invariants import check_pool, snapshot

BPS = 3
SLABS = range(3)
KEYS = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f", (b"a", 1)])
TTL = 50.0
MAX_CACHED = 5


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.pool = SlabPool(BPS, block_bytes=10, max_cached_bytes=10 * MAX_CACHED,
                             ttl=TTL, clock=self.clock)
        self.mirror = Mirror()
        self.ref: dict[int, int] = {}       # block_id -> refcount (held slabs only)
        self.key: dict[int, object] = {}    # block_id -> key
        self.lru: list[int] = []            # cached block ids, oldest first
        self.cached_at: dict[int, float] = {}
        self.tag: dict[int, int] = {}       # block_id -> the step its key was stored in
        self.aliases: dict[int, list] = {}  # block_id -> its other keys (lookups only), in order
        self.begun = self.done = 0
        self.draining: set[int] = set()     # slabs promised back: no block placed, none kept cached

    # ----------------------------------------------------------- helpers
    def blocks(self, ids):
        return [self.pool.block(i) for i in ids]

    def expect_failure(self, op):
        before = snapshot(self.pool)
        try:
            op()
        except PoolError:
            assert snapshot(self.pool) == before
            return True
        return False

    def live_ids(self):
        return sorted(i for i, r in self.ref.items() if r > 0)

    def reconcile_evictions(self, *, min_count=0, oldest_first=False, ttl_cutoff=None):
        """Blocks the pool evicted on its own: check, then apply to the model."""
        gone = [i for i in self.lru if self.pool.block(i).block_hash is None]
        if ttl_cutoff is not None:
            assert gone == [i for i in self.lru if self.cached_at[i] <= ttl_cutoff]
        if min_count:
            assert len(gone) >= min(min_count, len(self.lru))
        if oldest_first and gone:
            assert gone[0] == self.lru[0]
        for i in gone:
            self.lru.remove(i)
            self.key.pop(i, None)

    def after_free_limits(self):
        cutoff = self.clock.now - TTL
        expired = [i for i in self.lru if self.cached_at[i] <= cutoff]
        for i in expired:
            assert self.pool.block(i).block_hash is None
            self.lru.remove(i)
            self.key.pop(i, None)
        excess = len(self.lru) - MAX_CACHED
        if excess > 0:
            self.reconcile_evictions(min_count=excess, oldest_first=True)
        assert len(self.lru) <= MAX_CACHED

    def stored(self, ids, ks):
        """The pool stored these keys (a key a block already holds is not stored again)."""
        for i, k in zip(ids, ks):
            if self.key.get(i) != k:
                self.tag[i] = self.open_step()
                self.aliases.pop(i, None)      # a new key: the old one's aliases went with it
            self.key[i] = k

    def forget_unkeyed_aliases(self):
        """An alias leaves with its block's key (eviction, reclaim, clear)."""
        self.aliases = {i: ks for i, ks in self.aliases.items() if i in self.key}

    def open_step(self):
        return self.begun if self.begun > self.done else self.done

    # ------------------------------------------------------------- rules
    @rule()
    def begin_step(self):
        self.begun = self.pool.begin_step()

    @precondition(lambda self: self.begun > self.done)
    @rule(data=st.data())
    def end_step(self, data):
        step = data.draw(st.integers(self.done + 1, self.begun))
        self.pool.end_step(step)
        self.done = step

    @rule(slab=st.sampled_from(SLABS))
    def add_slab(self, slab):
        if slab * BPS in self.ref:
            assert self.expect_failure(lambda: self.pool.add_slab(slab))
            return
        self.pool.add_slab(slab)
        for i in range(slab * BPS, (slab + 1) * BPS):
            self.ref[i] = 0

    @rule(slab=st.sampled_from(SLABS))
    def take_slab_back(self, slab):
        ids = range(slab * BPS, (slab + 1) * BPS)
        if slab * BPS not in self.ref or any(self.ref[i] for i in ids):
            assert self.expect_failure(lambda: self.pool.take_slab_back(slab))
            return
        self.pool.take_slab_back(slab)
        self.draining.discard(slab)
        for i in ids:
            del self.ref[i]
            self.key.pop(i, None)
            if i in self.lru:
                self.lru.remove(i)

    @rule(n=st.integers(0, 9))
    def allocate(self, n):
        free = [i for i, r in self.ref.items() if r == 0 and i not in self.key and i // BPS not in self.draining]
        if n > len(free) + len(self.lru):
            assert self.expect_failure(lambda: self.pool.allocate(n))
            return
        got = [b.block_id for b in self.pool.allocate(n)]
        self.allocated(got, free, n)

    def allocated(self, got, free, n):
        n_free = min(n, len(free))
        assert set(got[:n_free]) <= set(free)           # free blocks first
        assert got[n_free:] == self.lru[:n - n_free]    # then LRU order
        for i in got:
            self.ref[i] = 1
            self.key.pop(i, None)
            if i in self.lru:
                self.lru.remove(i)

    @rule(extra=st.integers(1, 3))
    def allocate_past_free(self, extra):
        """Ask for more than the free blocks, so cached ones get reused."""
        self.allocate(self.pool.num_free + extra)

    @rule(data=st.data())
    def touch(self, data):
        candidates = [i for i, r in self.ref.items() if r > 0 or i in self.key]
        bad = data.draw(st.booleans()) and len(candidates) < len(self.ref)
        if bad:
            free = [i for i in self.ref if i not in candidates]
            ids = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=2))
            assert self.expect_failure(lambda: self.pool.touch(self.blocks(ids)))
            return
        if not candidates:
            return
        ids = data.draw(st.lists(st.sampled_from(candidates), max_size=4))
        self.pool.touch(self.blocks(ids))
        for i in ids:
            assert i not in self.pool.demoted     # a hit promotes
            if self.ref[i] == 0:
                self.lru.remove(i)
            self.ref[i] += 1

    @rule(data=st.data())
    def free(self, data):
        live = self.live_ids()
        if data.draw(st.booleans()) and len(live) < len(self.ref):
            dead = [i for i in self.ref if self.ref[i] == 0]
            ids = data.draw(st.lists(st.sampled_from(dead), min_size=1, max_size=2))
            assert self.expect_failure(lambda: self.pool.free(self.blocks(ids)))
            return
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), max_size=4, unique=True))
        self.pool.free(self.blocks(ids))
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0 and i in self.key:
                if i // BPS in self.draining:    # a draining slab keeps nothing cached
                    del self.key[i]
                    continue
                self.lru.append(i)
                self.cached_at[i] = self.clock.now
        self.after_free_limits()

    @rule(slabs=st.lists(st.sampled_from(SLABS), max_size=2))
    def drain(self, slabs):
        held = {i // BPS for i in self.ref}
        got = self.pool.drain(slabs)
        assert got == [s for s in dict.fromkeys(slabs) if s in held and s not in self.draining]
        for slab in got:
            self.draining.add(slab)
            for i in range(slab * BPS, (slab + 1) * BPS):
                if self.ref[i] == 0 and i in self.key:   # its cache goes now
                    del self.key[i]
                    self.lru.remove(i)
        assert self.pool.num_free == sum(1 for i, r in self.ref.items()
                                         if r == 0 and i not in self.key and i // BPS not in self.draining)

    @rule(slabs=st.one_of(st.none(), st.lists(st.sampled_from(SLABS), max_size=2)))
    def undrain(self, slabs):
        got = self.pool.undrain(slabs)
        expected = sorted(self.draining) if slabs is None else [s for s in dict.fromkeys(slabs) if s in self.draining]
        assert sorted(got) == sorted(expected)
        self.draining -= set(got)

    @rule(data=st.data())
    def cache(self, data):
        live = self.live_ids()
        if data.draw(st.booleans()) or not live:
            pool_ids = sorted(self.ref) or [0]
            ids = data.draw(st.lists(st.sampled_from(pool_ids + [99]), min_size=1, max_size=3, unique=True))
        else:
            ids = data.draw(st.lists(st.sampled_from(live), max_size=3, unique=True))
        ks = data.draw(st.lists(KEYS, min_size=len(ids), max_size=len(ids)))
        if not all(i in self.ref and self.ref[i] > 0 for i in ids):
            assert self.expect_failure(lambda: self.pool.cache(
                [self.pool.block(i) if i in self.ref else Block(i) for i in ids], ks))
            return
        self.pool.cache(self.blocks(ids), ks)
        self.stored(ids, ks)

    @rule(n=st.integers(1, 4), data=st.data())
    def request(self, n, data):
        """A request's life: allocate, fill and cache its blocks, free tail first
        (the blocks it was given: not others that happen to be live and unkeyed,
        which may sit in a draining slab)."""
        free = [i for i, r in self.ref.items() if r == 0 and i not in self.key and i // BPS not in self.draining]
        if n > len(free) + len(self.lru):
            return
        got = [b.block_id for b in self.pool.allocate(n)]
        self.allocated(got, free, n)
        ks = data.draw(st.lists(KEYS, min_size=len(got), max_size=len(got)))
        self.pool.cache(self.blocks(got), ks)
        self.stored(got, ks)
        self.pool.free(self.blocks(got[::-1]))
        for i in got[::-1]:
            self.ref[i] -= 1
            self.lru.append(i)
            self.cached_at[i] = self.clock.now
        self.after_free_limits()

    @rule(lead=st.integers(0, 8))
    def demote(self, lead):
        before = set(self.pool.demoted)
        added = self.pool.demote(lead)
        after = self.pool.demoted
        assert before <= after and len(after) - len(before) == added
        # the least recently used first, until free + demoted make the lead (or the cache runs out)
        expect = max(0, min(lead - self.pool.num_free - len(before), len(self.lru) - len(before)))
        assert added == expect
        assert after - before == set([i for i in self.lru if i not in before][:added])

    @rule()
    def restore_demoted(self):
        demoted = len(self.pool.demoted)
        assert self.pool.restore_demoted() == demoted
        assert not self.pool.demoted

    @rule(data=st.data())
    def alias(self, data):
        """vLLM's partial-block entry: another key for a keyed block, lookups only."""
        self.forget_unkeyed_aliases()
        pool_ids = sorted(self.ref)
        if not pool_ids:
            return
        i, k = data.draw(st.sampled_from(pool_ids)), data.draw(KEYS)
        if i not in self.key:
            assert self.expect_failure(lambda: self.pool.alias(self.pool.block(i), k))
            return
        new = k != self.key[i] and k not in self.aliases.get(i, [])
        assert self.pool.alias(self.pool.block(i), k) is new
        if new:
            self.aliases.setdefault(i, []).append(k)

    @rule(ks=st.lists(KEYS, max_size=4))
    def lookup(self, ks):
        self.forget_unkeyed_aliases()
        hits = self.pool.lookup(ks)
        reach = {i: [k, *self.aliases.get(i, [])] for i, k in self.key.items()}
        expected = 0
        for k in ks:
            if not any(k in keys for keys in reach.values()):
                break
            expected += 1
        assert len(hits) == expected
        for blk, k in zip(hits, ks):
            assert k in reach[blk.block_id]

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        evicted = self.pool.evict(n)
        before = len(self.lru)
        self.reconcile_evictions(min_count=n, oldest_first=True)
        assert evicted == before - len(self.lru)

    @rule(dt=st.floats(0, 40))
    def advance_clock_and_expire(self, dt):
        self.clock.now += dt
        self.pool.expire()
        self.reconcile_evictions(ttl_cutoff=self.clock.now - TTL)

    @precondition(lambda self: True)
    @rule()
    def clear_index(self):
        self.pool.clear_index()
        self.key.clear()
        self.lru.clear()

    @rule()
    def reset(self):
        if self.live_ids():
            assert self.expect_failure(self.pool.reset)
            return
        self.pool.reset()
        self.key.clear()
        self.lru.clear()

    # -------------------------------------------------------- invariants
    @invariant()
    def pool_matches_model(self):
        assert self.pool.demoted <= set(self.lru)
        if not self.pool.journal.removed:   # no seal due: whatever the daemon would keep still holds
            held = set(self.pool.slab_ids())
            for i, k in self.mirror.key_of.items():
                if i // BPS in held and i not in self.mirror.demoted:
                    assert self.pool.block(i).block_hash == k, (i, k)
        check_pool(self.pool, self.mirror)
        for i, r in self.ref.items():
            blk = self.pool.block(i)
            assert blk.ref_cnt == r
            assert blk.block_hash == self.key.get(i)
        assert self.pool.lru_ids() == self.lru
        assert set(self.pool.slab_ids()) == {i // BPS for i in self.ref}
        assert set(self.pool.draining_slabs()) == self.draining
        assert sorted(self.pool.drained_slabs()) == sorted(
            s for s in self.draining if not any(self.ref[i] for i in range(s * BPS, (s + 1) * BPS)))
        self.forget_unkeyed_aliases()
        for i in self.ref:
            assert self.pool.keys_of(self.pool.block(i)) == ([self.key[i], *self.aliases.get(i, [])]
                                                             if i in self.key else [])
        valid = {slab * BPS + off: key for slab, entries in self.mirror.valid_blocks(BPS).items()
                 for off, key in entries}
        assert valid == {i: k for i, k in self.key.items() if self.tag[i] <= self.done and i not in self.pool.demoted}


TestPoolStateful = PoolMachine.TestCase
TestPoolStateful.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
