"""TierIndex: the books of the tier below device memory (docs/tier.md).

Maps (namespace, block key) to a *slot*: an id naming one block's bytes in a
store (a file on disk, later a page of pinned host memory). Pure logic, like
``kvelastic/core``: no I/O, no clock (every call that ages values takes
``now``, monotonic seconds), no threads; the daemon's loop drives it and the
stores move the bytes.

An entry's life: ``reserve`` (pending: its bytes are being written, it holds
budget, it cannot be found) -> ``commit`` (findable) or ``abort`` (gone);
``lookup`` pins the entries of the prefix it finds (a load in flight) and
``unpin`` releases them; an entry leaves by eviction, ``invalidate`` of its
namespace or ``drop`` (its bytes failed their check). An entry that a load
or a write still holds when it is invalidated or dropped becomes *dead*:
never found nor served again; its bytes go at once, a write of them queued
or running is cancelled (a restart must not find them), and its budget is
held until the last holder lets go.

Slots are never reused: a slot names one block's bytes for life, so a late
``unpin`` or ``commit`` can never touch a newer block, and a store deleting a
released slot's bytes can never delete a newer block's. The slots whose bytes
may go (freed, or dead) are handed out by ``take_released``, each once.

Eviction is by value (docs/tier.md says why), leaves first: an entry another
live entry names as its parent is not evicted before that child, since a
prefix lookup stops at the first missing key and would strand the child. Of
the leaves, the one of least value goes, where

    value = cost / nbytes * hits(now),  hits(now) = sum over references r of 2 ** (-(now - t_r) / half_life)

(the demotion itself is the first reference). Since every term decays at the
same rate, the order of two entries changes only when one is referenced, so
the leaves sit in a heap keyed by ``log2(value) + now / half_life``, a
constant between references.

The state, the moves every operation shares and the invariants ``check``
asserts are ``books.py``'s (``TierBooks``); here, the operations.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvelastic.tier.books import TierBooks, TierEntry
from kvelastic.tier.errors import TierSlotState
from kvelastic.tier.pins import PinBooks, Tenant

# The largest block the tier takes (64 messages' worth): a fetch's block is
# read and verified whole before its first chunk is served, and held for its
# engine's next chunks, so its size bounds what one fetch costs the reader.
# A larger block is never reserved (not demoted) nor restored (its file goes).
MAX_BLOCK_BYTES = 64 << 20


class TierIndex(TierBooks):
    """The tier's index and eviction (module docstring)."""

    def __init__(self, budget_bytes: int, *, half_life: float = 300.0, pins: PinBooks | None = None,
                 media: tuple[str, ...] = ("disk",), lower_bytes: int | None = None) -> None:
        """``budget_bytes``: the top level's (``media[0]``); ``lower_bytes``:
        the level under it (``media[1]``), where there are two."""
        super().__init__(budget_bytes, half_life=half_life, lower_bytes=lower_bytes)
        if len(media) != len(self.budgets):
            raise ValueError(f"{len(self.budgets)} level(s) and media {media}")
        self.media = media                                  # what holds each level's bytes (``media.MEDIA``)
        self.pins = PinBooks() if pins is None else pins    # each tenant's share, each block's stretch

    @property
    def medium(self) -> str:
        """The media top to bottom, as reports name them: ``host``, ``disk``, ``host+disk``."""
        return "+".join(self.media)

    def check(self) -> None:
        """The books' invariants (``books.py``), and the pins': each tenant's
        add up to the entries', a stretch for each pinned entry."""
        super().check()
        self.pins.check({slot: (e.pins, e.nbytes) for slot, e in self._entries.items()})

    # --------------------------------------------------------- demotion
    def reserve(self, namespace: str, key: bytes, nbytes: int, cost: float, now: float,
                parent: bytes | None = None) -> int | None:
        """Room for a demoted block's bytes: its slot (pending until ``commit``),
        or None when the block is over ``MAX_BLOCK_BYTES``, the key is in the
        tier already or nothing can be evicted to make room. May evict
        entries (``take_released``) or move them down (``take_moves``). The
        block goes to the top level, or, where what the top holds leaves it
        too little (writes and loads in flight), to the first level below
        with room (``level_of``)."""
        if nbytes <= 0 or not cost > 0 or parent == key:
            raise ValueError(f"nbytes and cost must be > 0 and a block is not its own parent, got {nbytes}, {cost}")
        if nbytes > MAX_BLOCK_BYTES:
            return None
        if key in self._keys.get(namespace, {}):
            self.stats.already_held += 1
            return None
        level = next((lv for lv in range(len(self.budgets)) if self._make_room(nbytes, "value", lv)), None)
        if level is None:
            self.stats.rejected_full += 1
            return None
        slot = self._next_slot
        self._next_slot += 1
        e = TierEntry(slot, namespace, key, parent, nbytes, cost, now)
        e.level = level
        self._add(e)
        return slot

    def commit(self, slot: int) -> bool:
        """The slot's bytes are written: it can be found. False when it was
        invalidated while written: it is freed instead, never found."""
        e = self._entry(slot)
        if e.committed:
            raise TierSlotState(f"slot {slot} is committed already")
        if e.dead:
            self._free(e)
            return False
        e.committed = True
        self._account(e, 0, -e.nbytes)
        self.stats.demotions += 1
        self._refresh(e)
        return True

    def moved(self, slot: int) -> bool:
        """The slot's bytes reached the level it was moved to (``take_moves``).
        False when it died meanwhile (its move was cancelled by its delete):
        freed once no load holds it."""
        e = self._entry(slot)
        if not e.moving:
            raise TierSlotState(f"slot {slot} is not moving")
        e.moving = False
        if e.dead:                  # still held (dead): its bytes went with its delete
            if not e.pins:
                self._free(e)
            return False
        if not e.held:
            self._account(e, 0, -e.nbytes)
        self.stats.moves += 1
        self._refresh(e)
        return True

    def servable(self, slot: int) -> bool:
        """Whether the slot's bytes may still be served: committed, and not
        invalidated or dropped since (a load's pin keeps a dead entry's bytes,
        never its right to be read)."""
        e = self._entries.get(slot)
        return e is not None and e.committed and not e.dead

    def abort(self, slot: int, reason: str = "io") -> None:
        """The slot's bytes could not be written: it is freed, counted under ``reason``."""
        e = self._entry(slot)
        if e.committed:
            raise TierSlotState(f"slot {slot} is committed: drop it instead")
        self._count_failure(reason)
        if not e.dead:
            self._unlink(e)
        self._free(e)

    def restore(self, namespace: str, key: bytes, nbytes: int, slot: int, cost: float, now: float,
                parent: bytes | None = None) -> bool:
        """A committed entry found by a store after a restart, at its own slot,
        on the last level (the medium that outlives the daemon). False
        (nothing added: the caller deletes the bytes) when the block is over
        ``MAX_BLOCK_BYTES``, the key is held already or the level has no room
        for it after evicting by value."""
        if nbytes <= 0 or not cost > 0 or slot < 0 or parent == key:
            raise ValueError(f"bad entry: nbytes {nbytes}, cost {cost}, slot {slot}, its own parent {parent == key}")
        if slot in self._entries or slot in self._released:
            raise TierSlotState(f"slot {slot} is in use")
        level = self.last_level
        if nbytes > MAX_BLOCK_BYTES or key in self._keys.get(namespace, {}) or \
                not self._make_room(nbytes, "budget", level):
            return False
        self._next_slot = max(self._next_slot, slot + 1)
        e = TierEntry(slot, namespace, key, parent, nbytes, cost, now)
        e.level = level
        self._add(e)
        e.committed = True
        self._account(e, 0, -nbytes)
        self.stats.restored += 1
        self._refresh(e)
        return True

    def set_budget(self, budget_bytes: int, level: int | None = None) -> bool:
        """A new budget for ``level`` (None: the last); over it, its entries of
        least value go (``budget``: moved down, or evicted at the last level)
        until they fit. False when what loads and writes hold does not fit
        (the budget is set, and the rest goes as they let go)."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        level = self.last_level if level is None else level
        self.budgets[level] = budget_bytes
        return self._make_room(0, "budget", level)

    # -------------------------------------------------------- promotion
    def lookup(self, namespace: str, keys: Sequence[bytes], now: float, *, tenant: Tenant = None) -> list[int]:
        """The slots of the longest run of committed entries for ``keys[0]``,
        ``keys[1]``, ...: each one hit at ``now`` and pinned until ``unpin``
        (``pin``: within ``tenant``'s share, none of them resting)."""
        return self.pin(namespace, keys, now, tenant=tenant)[0]

    def pin(self, namespace: str, keys: Sequence[bytes], now: float, *,
            tenant: Tenant = None) -> tuple[list[int], str]:
        """``lookup``, and why the run was cut short of what the tier holds: ""
        (it was not), "pin_share" (``tenant`` pins its share: of the budget's
        bytes, or of pins), "pin_held" (the next block was pinned too long, or
        rests: ``pins.py``); the cut is counted (``stats.refused``)."""
        found: list[TierEntry] = []
        cut, taking = "", 0
        table = self._keys.get(namespace, {})
        for key in keys:
            slot = table.get(key)
            if slot is None or not self._entries[slot].committed:
                break
            e = self._entries[slot]
            if not self.pins.pinnable(slot, e.pins > 0, now):
                cut = "pin_held"
            elif not self.pins.fits(tenant, self.budget_bytes, len(found), taking, e.nbytes):
                cut = "pin_share"
            if cut:
                self.stats.refused[cut] += 1
                break
            found.append(e)
            taking += e.nbytes
        for e in found:
            self._hit(e, now)
            self.pins.pinned(tenant, e.slot, e.nbytes, e.pins == 0, now)
            if not e.held:
                self._account(e, 0, e.nbytes)
            e.pins += 1
            e.heap_seq = -1     # pinned: not evictable; re-queued at its new value when unpinned
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(keys)
        self.stats.hit_blocks += len(found)
        self.stats.miss_blocks += len(keys) - len(found)
        return [e.slot for e in found], cut

    def unpin(self, slots: Sequence[int], *, loaded: bool | None = True, tenant: Tenant = None,
              now: float | None = None) -> None:
        """The load of ``slots`` by ``tenant`` (whose ``lookup`` pinned them)
        ended at ``now``: well (``loaded``), or not (counted as a ``load``
        failure), or they were not loaded and that is no failure (``None``:
        released unused, or dropped and counted as such). A dead entry is
        freed with its last pin. A block whose last pin ends may rest
        (``pins.py``; never without ``now``)."""
        wanted: dict[int, int] = {}
        for slot in slots:
            wanted[slot] = wanted.get(slot, 0) + 1
        for slot, n in wanted.items():
            if self._entry(slot).pins < n:
                raise TierSlotState(f"slot {slot} is unpinned {n} time(s) with {self._entries[slot].pins} pin(s)")
        self.pins.check_unpin(tenant, len(slots), sum(self._entries[s].nbytes for s in slots))
        for slot in slots:
            e = self._entries[slot]
            e.pins -= 1
            self.pins.unpinned(tenant, slot, e.nbytes, e.pins == 0, loaded, None if e.dead else now)
            if e.pins == 0:
                if e.dead:
                    if not e.moving:       # else freed when its move reports back (``moved``, ``drop``)
                        self._free(e)
                elif not e.held:
                    self._account(e, 0, -e.nbytes)
                    self._refresh(e)
        if len(self.pins.rest) > 2 * len(self._entries) + 64:     # rests of freed slots: drop them
            self.pins.forget(self._entries)
        if loaded:
            self.stats.promotions += len(slots)
        elif loaded is not None:
            self.stats.failures["load"] += len(slots)

    # ------------------------------------------------------------- loss
    def invalidate(self, namespace: str) -> int:
        """Every entry of ``namespace`` leaves (held ones die); how many left."""
        table = self._keys.pop(namespace, {})
        self._children.pop(namespace, None)
        for slot in table.values():
            e = self._entries[slot]
            if e.held:
                self._kill(e)
            else:
                self._free(e)
        self.stats.evictions["invalidate"] += len(table)
        return len(table)

    def drop(self, slot: int, reason: str) -> None:
        """A committed slot's bytes failed (a torn file, a checksum): it is never
        found again, and freed once no load holds it. Counted under ``reason``."""
        e = self._entry(slot)
        if not e.committed:
            raise TierSlotState(f"slot {slot} is pending: abort it instead")
        self._count_failure(reason)
        if e.moving:                       # a move that failed: it holds the block no longer
            e.moving = False
            if not e.held:
                self._account(e, 0, -e.nbytes)
        if e.dead:
            if not e.pins:
                self._free(e)
            return
        self._unlink(e)
        if e.pins:
            self._kill(e)
        else:
            self._free(e)
