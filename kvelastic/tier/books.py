"""TierBooks: the tier index's state, what it answers about it, the moves
every operation shares, and its invariants (``index.py`` says what the tier
does with them; docs/tier.md why).

**Levels.** The tier may span two media, one above the other (host memory
over the disk): each entry lives at one *level* (0, the top, where every
block enters), each level has its own budget. Making room at a level above
the last *moves* its least valuable blocks one level down (they stay
findable; ``take_moves`` hands out the slots whose bytes the store must
move) rather than evicting them; only the last level evicts for good. So a
block leaves the tier by value across both media: host, then disk, then
gone. With one level (one medium) nothing moves, and the tier is as it was.

Invariants (``check``): a key is in at most one live entry per namespace and
the key map holds exactly the live entries; bytes in use (pending, committed,
dead, moving) never exceed a level's budget, and ``held_bytes`` counts
exactly the held ones, per level too; a pinned entry is never freed; a
released slot holds nothing; every evictable entry (committed, live,
unpinned, not moving; at the last level a leaf too: no live child) has
exactly one current record in its level's heap, at its current priority,
and no other entry has one.
"""

from __future__ import annotations

import heapq
import math

from kvelastic.errors import require
from kvelastic.tier.errors import UnknownTierSlot
from kvelastic.tier.stats import EVICTION_REASONS, FAILURE_REASONS, TierStats


class TierEntry:
    """One block in the tier. ``hits`` is the decayed reference count as of
    ``at``; ``heap_seq`` the sequence number of its current heap record, or
    -1 when it has none (it is not an evictable leaf)."""

    __slots__ = ("at", "committed", "cost", "dead", "gone", "heap_seq", "hits", "key", "level", "moving",
                 "namespace", "nbytes", "parent", "pins", "slot")

    def __init__(self, slot: int, namespace: str, key: bytes, parent: bytes | None, nbytes: int,
                 cost: float, now: float) -> None:
        self.slot = slot
        self.namespace = namespace
        self.key = key
        self.parent = parent
        self.nbytes = nbytes
        self.cost = cost
        self.hits = 1.0
        self.at = now
        self.pins = 0
        self.committed = False
        self.dead = False
        self.gone = False       # dead, and its bytes handed out for deletion already (``TierBooks._kill``)
        self.heap_seq = -1
        self.level = 0          # the medium it lives on: 0 the top (module docstring)
        self.moving = False     # counted at ``level`` already, its bytes being moved there from the level above

    @property
    def held(self) -> bool:
        """Its bytes cannot be evicted now: being written, being loaded, being moved, or dead."""
        return not self.committed or self.pins > 0 or self.dead or self.moving


class TierBooks:
    """The index's state and shared moves (module docstring)."""

    def __init__(self, budget_bytes: int, *, half_life: float = 300.0, lower_bytes: int | None = None) -> None:
        """``budget_bytes``: the top level's budget; ``lower_bytes``: a second
        level's under it (None: one level)."""
        budgets = [budget_bytes] if lower_bytes is None else [budget_bytes, lower_bytes]
        if min(budgets) < 0:
            raise ValueError(f"budgets must be >= 0, got {budgets}")
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.budgets = budgets
        self.half_life = half_life
        self.bytes_used = 0     # every entry's bytes: pending, committed, dead and moving
        self.held_bytes = 0     # of those, the bytes no eviction can free now (TierEntry.held)
        self.level_used = [0] * len(budgets)     # the same two, per level
        self.level_held = [0] * len(budgets)
        self.stats = TierStats()
        self._entries: dict[int, TierEntry] = {}
        self._keys: dict[str, dict[bytes, int]] = {}        # live entries: namespace -> key -> slot
        self._children: dict[str, dict[bytes, int]] = {}    # namespace -> key -> live entries naming it parent
        # Each level's evictable entries (leaves only at the last): (priority, seq, slot).
        self._heaps: list[list[tuple[float, int, int]]] = [[] for _ in budgets]
        self._seq = 0
        self._next_slot = 0
        self._released: list[int] = []
        self._moves: list[int] = []

    @property
    def budget_bytes(self) -> int:
        """The whole tier's budget, every level's: what a tenant's share is of."""
        return sum(self.budgets)

    @property
    def last_level(self) -> int:
        return len(self.budgets) - 1

    # ------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._entries)

    def namespaces(self) -> dict[str, int]:
        """Namespace -> its blocks that can be found or are being written (live)."""
        return {ns: len(keys) for ns, keys in self._keys.items() if keys}

    def writing(self, namespace: str | None = None) -> int:
        """Entries reserved whose bytes are not written yet (not findable), of
        ``namespace`` only (live ones) where given."""
        if namespace is not None:
            return sum(not self._entries[slot].committed for slot in self._keys.get(namespace, {}).values())
        return sum(not e.committed for e in self._entries.values())

    def key_of(self, slot: int) -> tuple[str, bytes]:
        """(namespace, key) of a slot's entry: what its bytes must say they are."""
        e = self._entry(slot)
        return e.namespace, e.key

    def nbytes(self, slot: int) -> int:
        return self._entry(slot).nbytes

    def value(self, slot: int, now: float) -> float:
        """The entry's value at ``now`` (``index.py``): recompute cost per byte times decayed hits."""
        e = self._entry(slot)
        return e.cost / e.nbytes * self._decayed(e, now)

    def skip_slots(self, first: int) -> None:
        """Hand out no slot below ``first``: slots a store has seen (files found after a restart)."""
        self._next_slot = max(self._next_slot, first)

    def take_released(self) -> list[int]:
        """Slots whose bytes may be deleted since the last call: freed ones,
        and dead ones a load still holds (never served again: ``_kill``)."""
        released, self._released = self._released, []
        return released

    def take_moves(self) -> list[int]:
        """Slots whose bytes the store must move one level down since the
        last call (``moved`` or ``drop`` reports each back)."""
        moves, self._moves = self._moves, []
        return moves

    def moving(self, slot: int) -> bool:
        e = self._entries.get(slot)
        return e is not None and e.moving

    def level_of(self, slot: int) -> int:
        return self._entry(slot).level

    # -------------------------------------------------------- internals
    def _entry(self, slot: int) -> TierEntry:
        e = self._entries.get(slot)
        if e is None:
            raise UnknownTierSlot(f"no tier entry holds slot {slot}")
        return e

    def _count_failure(self, reason: str) -> None:
        if reason not in FAILURE_REASONS:
            raise ValueError(f"unknown failure reason {reason!r} (one of {FAILURE_REASONS})")
        self.stats.failures[reason] += 1

    def _decayed(self, e: TierEntry, now: float) -> float:
        """``e``'s hits as of ``now`` (never later than its last reference: ``now`` is monotonic)."""
        return e.hits * math.pow(2.0, -max(0.0, now - e.at) / self.half_life)

    def _hit(self, e: TierEntry, now: float) -> None:
        e.hits = self._decayed(e, now) + 1.0
        e.at = max(e.at, now)

    def _priority(self, e: TierEntry) -> float:
        """``log2(value) + now / half_life``: the same at any ``now`` until ``e`` is referenced again."""
        return math.log2(e.cost / e.nbytes) + math.log2(e.hits) + e.at / self.half_life

    def _is_leaf(self, e: TierEntry) -> bool:
        return not self._children.get(e.namespace, {}).get(e.key)

    def _evictable(self, e: TierEntry) -> bool:
        """Whether making room at ``e``'s level may take it: a block moved down
        stays findable, so above the last level it need not be a leaf."""
        return e.committed and not e.dead and e.pins == 0 and not e.moving and \
            (e.level < self.last_level or self._is_leaf(e))

    def _refresh(self, e: TierEntry) -> None:
        """Give ``e`` a current record in its level's heap if it is evictable there, else none."""
        if self._evictable(e):
            self._seq += 1
            e.heap_seq = self._seq
            heap = self._heaps[e.level]
            heapq.heappush(heap, (self._priority(e), self._seq, e.slot))
            if len(heap) > 2 * len(self._entries) + 64:     # stale records: drop them
                heap[:] = [r for r in heap if self._current(r)]
                heapq.heapify(heap)
        else:
            e.heap_seq = -1

    def _current(self, record: tuple[float, int, int]) -> bool:
        e = self._entries.get(record[2])
        return e is not None and e.heap_seq == record[1]

    def _make_room(self, nbytes: int, reason: str, level: int = 0) -> bool:
        """Make ``nbytes`` fit at ``level``: its entries of least value move a
        level down (above the last, where the level below makes room for them
        in turn), or are evicted (at the last level, leaves only; or where the
        level below cannot take them). False when they cannot fit: at once if
        held bytes leave too little, else once nothing is left to take (the
        entries taken on the way stay taken: they were the least valuable,
        and this happens only when nearly all is held)."""
        budget = self.budgets[level]
        if nbytes > budget - self.level_held[level]:
            return False
        heap = self._heaps[level]
        while self.level_used[level] + nbytes > budget:
            while heap and not self._current(heap[0]):
                heapq.heappop(heap)
            if not heap:
                return False
            e = self._entries[heapq.heappop(heap)[2]]
            e.heap_seq = -1
            if level < self.last_level and self._make_room(e.nbytes, "value", level + 1):
                self._account(e, -e.nbytes, 0)                 # evictable: not held
                # No record while it moves (making room below may have refreshed it: a child evicted).
                e.level, e.moving, e.heap_seq = level + 1, True, -1
                self._account(e, e.nbytes, e.nbytes)
                self._moves.append(e.slot)
                self.stats.moved_down += 1
                continue
            if not self._is_leaf(e):           # it would strand its children: nothing below takes it
                self._refresh(e)
                return False
            self._unlink(e)
            self._free(e)
            self.stats.evictions[reason] += 1
        return True

    def _account(self, e: TierEntry, used: int, held: int) -> None:
        """Bytes in use and held, changed by ``used`` and ``held``, at ``e``'s level and in all."""
        self.bytes_used += used
        self.held_bytes += held
        self.level_used[e.level] += used
        self.level_held[e.level] += held

    def _add(self, e: TierEntry) -> None:
        """A new pending entry, live: in the key map, counted as its parent's child."""
        self._entries[e.slot] = e
        self._account(e, e.nbytes, e.nbytes)
        self._keys.setdefault(e.namespace, {})[e.key] = e.slot
        if e.parent is not None:
            children = self._children.setdefault(e.namespace, {})
            children[e.parent] = children.get(e.parent, 0) + 1
            if children[e.parent] == 1:
                self._refresh_key(e.namespace, e.parent)    # no longer a leaf

    def _unlink(self, e: TierEntry) -> None:
        """A live entry leaves the key map (and its parent's children)."""
        table = self._keys[e.namespace]
        del table[e.key]
        if not table:
            del self._keys[e.namespace]
        if e.parent is not None:
            children = self._children[e.namespace]
            children[e.parent] -= 1
            if not children[e.parent]:
                del children[e.parent]
                if not children:
                    del self._children[e.namespace]
                self._refresh_key(e.namespace, e.parent)    # a leaf again

    def _refresh_key(self, namespace: str, key: bytes) -> None:
        slot = self._keys.get(namespace, {}).get(key)
        if slot is not None:
            self._refresh(self._entries[slot])

    def _kill(self, e: TierEntry) -> None:
        """A held entry leaves (invalidated, dropped): never found nor served
        again, its budget held until the last holder lets go. A committed
        one's bytes go at once, pinned or not: a dead slot is never read (a
        fetch of it is answered "not served"), and a file kept for a load
        would be restored live by a daemon restarted before the load ends.
        A pending one's bytes are being written, or queued to be: they go at
        once too, which cancels the write (the store's writer never writes a
        slot deleted before it ran, and a delete after it removes the file),
        so neither a stop that writes what is queued nor a crash between a
        write and the loop's next pass leaves a file for a restart to find.
        Its budget is held until the write's report (``commit``, ``abort``)
        frees it."""
        e.dead, e.heap_seq = True, -1
        if not e.gone:
            e.gone = True
            self._released.append(e.slot)

    def _free(self, e: TierEntry) -> None:
        require(e.pins == 0, f"slot {e.slot} freed while {e.pins} load(s) hold it")
        self._account(e, -e.nbytes, -e.nbytes if e.held else 0)
        e.heap_seq = -1
        del self._entries[e.slot]
        if not e.gone:
            self._released.append(e.slot)

    # ------------------------------------------------------------ check
    def check(self) -> None:
        """Raise ``InvariantViolation`` unless every invariant holds (module docstring)."""
        live = {slot for slot, e in self._entries.items() if not e.dead}
        mapped = [(ns, key, slot) for ns, table in self._keys.items() for key, slot in table.items()]
        require(all(table for table in self._keys.values()), "an empty namespace table is kept")
        require(sorted(s for _, _, s in mapped) == sorted(live), "the key map is not the live entries")
        for ns, key, slot in mapped:
            e = self._entries[slot]
            require((e.namespace, e.key) == (ns, key), f"slot {slot} is mapped under another key")
        children: dict[str, dict[bytes, int]] = {}
        for slot in live:
            e = self._entries[slot]
            if e.parent is not None:
                table = children.setdefault(e.namespace, {})
                table[e.parent] = table.get(e.parent, 0) + 1
        require(children == self._children, "child counts are off")
        require(self.bytes_used == sum(e.nbytes for e in self._entries.values()), "bytes_used is off")
        require(self.held_bytes == sum(e.nbytes for e in self._entries.values() if e.held), "held_bytes is off")
        for level, budget in enumerate(self.budgets):
            at = [e for e in self._entries.values() if e.level == level]
            require(self.level_used[level] == sum(e.nbytes for e in at), f"level {level}: bytes in use are off")
            require(self.level_held[level] == sum(e.nbytes for e in at if e.held), f"level {level}: held is off")
            require(self.level_used[level] <= budget, f"level {level}: bytes in use exceed its budget")
        require(all(e.committed and 0 < e.level for e in self._entries.values() if e.moving),
                "a block moves that is not committed, or moves up")
        require(set(self._moves) <= {s for s, e in self._entries.items() if e.moving} | set(self._released),
                "a move is handed out for a block that does not move")
        require(all(e.pins > 0 or not e.committed or e.moving for e in self._entries.values() if e.dead),
                "a dead entry nothing holds was not freed")
        require(all(e.pins == 0 for e in self._entries.values() if not e.committed), "a pending entry is pinned")
        released = set(self._released)
        require(all(self._entries[s].gone for s in released & self._entries.keys()),
                "a released slot holds an entry whose bytes are still wanted")
        require(all(e.dead for e in self._entries.values() if e.gone), "the bytes of a live entry were handed out")
        require(all(e.gone for e in self._entries.values() if e.dead), "a dead entry's bytes were kept")
        require(all(0 <= s < self._next_slot for s in [*released, *self._entries]), "a slot was never handed out")
        records = [{(seq, slot): prio for prio, seq, slot in heap} for heap in self._heaps]
        for slot, e in self._entries.items():
            evictable = self._evictable(e)
            require(evictable == (e.heap_seq != -1), f"slot {slot}: heap record and evictability disagree")
            if evictable:
                require(records[e.level].get((e.heap_seq, slot)) == self._priority(e),
                        f"slot {slot}: no current record")
        require(set(EVICTION_REASONS) == self.stats.evictions.keys(), "eviction reasons changed")
