"""Random sequences of every TierIndex operation, checked against a plain model.

The model keeps each slot's entry (namespace, key, parent, size, pending or
committed, pins, dead, its bytes gone) in a dict. Where the index chooses (which entries to
evict for a demotion), the test checks the choice against the rules, in the
order the index made it: each victim an evictable leaf (committed, live,
unpinned, no live child) of least value among those left at that point, and
then applies it to the model. After every step: ``check()``, and the model's
bytes, held bytes, slots and failure counts equal the index's. What a lookup
finds is exactly the model's leading run of committed live keys, cut where
the next would take its tenant past its share (bytes or pins) or is pinned
too long or resting (``tier/pins.py``): the model keeps each tenant's pins
and each entry's stretch and rest, and every lookup, unpin and cut agrees.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvelastic.tier.errors import TierSlotState, UnknownTierSlot
from kvelastic.tier.index import TierIndex
from kvelastic.tier.pins import PinBooks
from kvelastic.tier.stats import FAILURE_REASONS, REFUSAL_REASONS

BUDGET = 100
NAMESPACES = st.sampled_from(["ns-a", "ns-b"])
KEYS = st.sampled_from([b"k0", b"k1", b"k2", b"k3", b"k4", b"k5"])
SIZES = st.sampled_from([10, 20, 30, 40])
COSTS = st.sampled_from([1.0, 2.0, 5.0, 100.0])
STEPS = st.sampled_from([0.0, 1.0, 50.0, 500.0])
REASONS = st.sampled_from([r for r in FAILURE_REASONS if r != "load"])
TENANTS = st.sampled_from([None, 1, 2])       # None: an in-process caller, unbounded
SHARE, MAX_PINS, MAX_PIN = 0.5, 4, 30.0       # a tenant pins 50 bytes, 4 pins; a stretch of 30 s


class TierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.index = TierIndex(BUDGET, half_life=100.0, pins=PinBooks(SHARE, MAX_PINS, MAX_PIN))
        self.budget = BUDGET
        self.now = 0.0
        self.entries: dict[int, dict] = {}      # slot -> entry
        self.seen: set[int] = set()             # every slot ever handed out
        self.loads: list[tuple[list[int], int | None]] = []   # lookups not unpinned yet, and their tenant
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)
        self.since: dict[int, float] = {}       # pinned slot -> its stretch's first pin
        self.unloaded: set[int] = set()         # pinned slots a pin of which ended without a load
        self.rest: dict[int, float] = {}        # slot -> not pinned before then

    # ----------------------------------------------------------- helpers
    def live(self, ns, key):
        for slot, e in self.entries.items():
            if (e["ns"], e["key"]) == (ns, key) and not e["dead"]:
                return slot
        return None

    def evictable(self, slot):
        e = self.entries[slot]
        children = [c for c in self.entries.values()
                    if c["ns"] == e["ns"] and c["parent"] == e["key"] and not c["dead"]]
        return e["committed"] and not e["dead"] and e["pins"] == 0 and not children

    def held(self):
        return sum(e["nbytes"] for e in self.entries.values()
                   if not e["committed"] or e["pins"] or e["dead"])

    def released(self, expected, aborted=None):
        """The slots whose bytes may go now are ``expected``: a freed one
        leaves the model, a dead one a load pins stays until its last unpin."""
        got = self.index.take_released()
        assert sorted(got) == sorted(expected), (got, expected)
        for slot in got:
            e = self.entries[slot]
            assert not e["gone"], f"slot {slot}'s bytes handed out twice"
            if e["pins"] or (e["dead"] and not e["committed"]):   # a load or a write holds it: it stays
                assert e["dead"], f"slot {slot}'s bytes go while a load needs them"
                e["gone"] = True
            elif not e["committed"]:
                assert slot == aborted, f"slot {slot}'s bytes go while its write needs them"
                del self.entries[slot]
            else:
                del self.entries[slot]

    def slots_where(self, data, pred):
        slots = sorted(s for s, e in self.entries.items() if pred(e))
        return data.draw(st.sampled_from(slots)) if slots else None

    # ------------------------------------------------------------- rules
    @rule(dt=STEPS)
    def advance(self, dt):
        self.now += dt

    @rule(ns=NAMESPACES, key=KEYS, nbytes=SIZES, cost=COSTS, parent=st.none() | KEYS, commit=st.booleans())
    def reserve(self, ns, key, nbytes, cost, parent, commit):
        """A demotion; with ``commit``, its write done at once (the common case)."""
        if parent == key:
            parent = None
        values = {s: self.index.value(s, self.now) for s, e in self.entries.items()
                  if e["committed"] and not e["dead"]}
        held_before, was_live = self.held(), self.live(ns, key) is not None
        slot = self.index.reserve(ns, key, nbytes, cost, self.now, parent)
        for victim in self.index.take_released():         # in the order the index evicted them
            assert self.evictable(victim), victim
            least = min(values[s] for s in self.entries if self.evictable(s))
            assert values[victim] <= least * (1 + 1e-9), (victim, values)
            del self.entries[victim]
        if was_live:
            assert slot is None and len(values) == len([s for s in self.entries if s in values])
        elif slot is None:
            assert nbytes > self.budget - held_before or not any(self.evictable(s) for s in self.entries)
        else:
            assert slot not in self.seen
            self.seen.add(slot)
            self.entries[slot] = dict(ns=ns, key=key, parent=parent, nbytes=nbytes,
                                      committed=False, pins=0, dead=False, gone=False)
            if commit:
                assert self.index.commit(slot)
                self.entries[slot]["committed"] = True

    @rule(fraction=st.sampled_from([1.0, 0.75, 0.5, 0.25]))
    def set_budget(self, fraction):
        """An operator's new KVELASTIC_TIER_SIZE (or a rebuild's): over it, least valuable leaves go first."""
        budget = int(BUDGET * fraction)
        values = {s: self.index.value(s, self.now) for s, e in self.entries.items()
                  if e["committed"] and not e["dead"]}
        fits = self.index.set_budget(budget)
        for victim in self.index.take_released():
            assert self.evictable(victim), victim
            least = min(values[s] for s in self.entries if self.evictable(s))
            assert values[victim] <= least * (1 + 1e-9), (victim, values)
            del self.entries[victim]
        if fits:
            self.budget = budget
            assert self.index.bytes_used <= budget
        else:       # held bytes leave too little, or no leaf is left to evict (held entries' ancestors)
            assert self.held() > budget or not any(self.evictable(s) for s in self.entries)
            assert self.index.set_budget(self.budget)   # back to the budget they fit in

    @rule(data=st.data())
    def commit(self, data):
        slot = self.slots_where(data, lambda e: not e["committed"])
        if slot is None:
            return
        dead = self.entries[slot]["dead"]
        assert self.index.commit(slot) is (not dead)
        self.entries[slot]["committed"] = True
        if dead:        # its write was cancelled when it died: it leaves without a release
            del self.entries[slot]
        self.released([])

    @rule(data=st.data(), reason=REASONS)
    def abort(self, data, reason):
        slot = self.slots_where(data, lambda e: not e["committed"])
        if slot is None:
            return
        self.index.abort(slot, reason)
        self.failures[reason] += 1
        if self.entries[slot]["gone"]:    # dead: its bytes went already
            del self.entries[slot]
            self.released([])
        else:
            self.released([slot], aborted=slot)

    def tenant_pins(self, tenant):
        """(pins, bytes) of ``tenant``'s loads not unpinned yet."""
        loads = [load for load, t in self.loads if t == tenant]
        return sum(map(len, loads)), sum(self.entries[s]["nbytes"] for load in loads for s in load)

    def cut(self, tenant, slot, pins, nbytes):
        """Why ``slot`` is not pinned after ``pins`` pins of ``nbytes`` this lookup, or ""."""
        e = self.entries[slot]
        if e["pins"] and self.now - self.since[slot] >= MAX_PIN or not e["pins"] and self.now < self.rest.get(slot, 0):
            return "pin_held"
        held_pins, held_bytes = self.tenant_pins(tenant)
        over = held_bytes + nbytes + e["nbytes"] > int(self.budget * SHARE) and held_pins + pins > 0   # first: any size
        if tenant is not None and (held_pins + pins >= MAX_PINS or over):
            return "pin_share"
        return ""

    @rule(ns=NAMESPACES, data=st.data(), tenant=TENANTS)
    def lookup(self, ns, data, tenant):
        """Keys drawn mostly from those the namespace holds, so that runs are found."""
        held = sorted({e["key"] for e in self.entries.values() if e["ns"] == ns and not e["dead"]})
        keys = data.draw(st.lists(st.sampled_from(held) if held else KEYS, max_size=4) | st.lists(KEYS, max_size=4))
        self.pin(ns, keys, tenant)

    @precondition(lambda self: self.loads)
    @rule(data=st.data(), dt=STEPS)
    def renew(self, data, dt):
        """A tenant looks up again, ``dt`` later, what one of its loads pins:
        the new leases that must not keep a block pinned on and on."""
        load, tenant = data.draw(st.sampled_from(self.loads))
        self.now += dt
        self.pin(self.entries[load[0]]["ns"], [self.entries[s]["key"] for s in load], tenant)

    def pin(self, ns, keys, tenant):
        expected, why = [], ""
        for key in keys:
            slot = self.live(ns, key)
            if slot is None or not self.entries[slot]["committed"]:
                break
            why = self.cut(tenant, slot, len(expected), sum(self.entries[s]["nbytes"] for s in expected))
            if why:
                self.refused[why] += 1
                break
            expected.append(slot)
        got, cut = self.index.pin(ns, keys, self.now, tenant=tenant)
        assert (got, cut) == (expected, why)
        for slot in got:
            if not self.entries[slot]["pins"]:
                self.since[slot] = self.now
                self.rest.pop(slot, None)
            self.entries[slot]["pins"] += 1
        if got:
            self.loads.append((got, tenant))

    @precondition(lambda self: self.loads)
    @rule(data=st.data(), loaded=st.sampled_from([True, False, None]))
    def unpin(self, data, loaded):
        load, tenant = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.index.unpin(load, loaded=loaded, tenant=tenant, now=self.now)
        if loaded is False:
            self.failures["load"] += len(load)
        for slot in load:
            self.entries[slot]["pins"] -= 1
            if not loaded:
                self.unloaded.add(slot)
            if not self.entries[slot]["pins"]:
                span = self.now - self.since.pop(slot)
                if not self.entries[slot]["dead"] and span > 0 and (slot in self.unloaded or span >= MAX_PIN):
                    self.rest[slot] = self.now + span
                self.unloaded.discard(slot)
        ended = [s for s in set(load) if self.entries[s]["dead"] and not self.entries[s]["pins"]]
        for slot in ended:
            if self.entries[slot]["gone"]:      # its bytes went when it died: it leaves without a release
                del self.entries[slot]
        self.released([s for s in ended if s in self.entries])

    @rule(ns=NAMESPACES)
    def invalidate(self, ns):
        mine = [s for s, e in self.entries.items() if e["ns"] == ns and not e["dead"]]
        assert self.index.invalidate(ns) == len(mine)
        # Their bytes go at once, pinned or being written (the write is
        # cancelled); the entry stays, holding budget, until the load or
        # the write ends.
        for slot in mine:
            self.entries[slot]["dead"] = True
        self.released(mine)

    @rule(data=st.data(), reason=REASONS)
    def drop(self, data, reason):
        slot = self.slots_where(data, lambda e: e["committed"])
        if slot is None:
            return
        self.index.drop(slot, reason)
        self.failures[reason] += 1
        e = self.entries[slot]
        was_dead, e["dead"] = e["dead"], True
        self.released([] if was_dead else [slot])       # its bytes go at once, loaded or not

    @rule(slot=st.integers(0, 40), op=st.sampled_from(["commit", "abort", "unpin", "drop"]))
    def wrong_call(self, slot, op):
        """A call the slot's state does not allow raises and changes nothing."""
        e = self.entries.get(slot)
        allowed = e is not None and {"commit": not e["committed"], "abort": not e["committed"],
                                     "unpin": e["pins"] > 0, "drop": e["committed"]}[op]
        if allowed:
            return
        before = (self.index.bytes_used, self.index.held_bytes, len(self.index), self.index.stats.counters())
        try:
            if op == "unpin":
                self.index.unpin([slot])
            elif op == "drop":
                self.index.drop(slot, "torn")
            else:
                getattr(self.index, op)(slot)
        except (UnknownTierSlot, TierSlotState):
            pass
        else:
            raise AssertionError(f"{op}({slot}) was accepted")
        assert (self.index.bytes_used, self.index.held_bytes, len(self.index),
                self.index.stats.counters()) == before

    # --------------------------------------------------------- invariants
    @invariant()
    def agrees_with_the_model(self):
        self.index.check()
        assert self.index.bytes_used == sum(e["nbytes"] for e in self.entries.values()) <= self.budget
        assert self.index.held_bytes == self.held()
        assert sorted(self.index._entries) == sorted(self.entries)
        for slot, e in self.entries.items():
            assert self.index.key_of(slot) == (e["ns"], e["key"])
            assert self.index._entries[slot].pins == e["pins"]
        assert self.index.stats.failures == self.failures
        assert self.index.stats.refused == self.refused
        pins = self.index.pins
        for tenant in (None, 1, 2):
            held = pins.tenants.get(tenant)
            assert ((held.pins, held.nbytes) if held else (0, 0)) == self.tenant_pins(tenant)
            # (Its bytes may exceed its share of a budget cut since: a pin is never taken back.)
            assert tenant is None or self.tenant_pins(tenant)[0] <= MAX_PINS
        assert {s: st.since for s, st in pins.stretches.items()} == self.since
        live_rests = {s: t for s, t in pins.rest.items() if s in self.entries and t > self.now}
        assert live_rests == {s: t for s, t in self.rest.items() if s in self.entries and t > self.now}
        for slot, e in self.entries.items():
            assert self.index._entries[slot].gone == e["gone"]


TestTierStateful = TierMachine.TestCase
TestTierStateful.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
