"""The tier's pins shared fairly (docs/tier.md, "Shares"): how much of the
tier one tenant may pin, and for how long one block stays pinned. Pure
bookkeeping for ``TierIndex.lookup`` and ``unpin``: no I/O, no clock (each
call takes ``now``).

A pinned block cannot be evicted, so pins are room taken from every other
tenant's demotions. Two rules bound them:

- **A share per tenant** (a uid; ``None``: an in-process caller, unbounded):
  the bytes its pins hold, each pin counted (two loads of one block count
  it twice: that over-counts a tenant's concurrent loads of one prefix, but
  bounds its state too, which counting distinct blocks would not), stay
  within ``share`` of the budget (or one block, its first pin: a tier too
  small for a share to hold a block), and its pins within ``max_pins``
  whatever their size. The share is a constant fraction (a quarter), not
  the budget divided among the tenants active now: a pin cannot be taken
  back in the middle of a load, so a share that shrank as tenants arrive
  could not be enforced on the pins already held; a constant one can, and
  leaves three quarters of the tier to the others' demotions whoever pins.
  A load needs what one prefix needs, far below a quarter of a tier.
- **A stretch, then a rest**: a block's *stretch* runs from its first pin to
  the moment it has none. A block pinned for ``max_pin`` seconds at a stretch
  takes no new pin (its pins end with their leases, within their deadline),
  and a stretch that lasted that long, or in which any pin ended without a
  load (released unused, its lease expired or its engine gone), is followed
  by a rest as long as the stretch, during which nothing pins the block. So
  no sequence of leases keeps a block pinned without loading it: new leases
  do not extend a stretch past ``max_pin``, and an unloaded one buys a rest
  as long as what it held. A stretch of short loads needs no rest (each
  load read the block: a hit, paid for by its reads), so one engine loading
  a prefix right after another never finds it resting; a tenant that reads
  a block again and again keeps it pinned most of the time, as a hot block
  is, at the cost of a read each time (within its share of the reader).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container

from kvelastic.errors import require
from kvelastic.tier.errors import TierSlotState

PIN_SHARE = 0.25           # of the tier's budget, the bytes one tenant's pins may hold
MAX_TENANT_PINS = 16384    # pins one tenant may hold (four full lookups): bounds its leases' state
MAX_PIN = 30.0             # seconds a block stays pinned at a stretch before it takes no new pin

Tenant = int | None


@dataclasses.dataclass
class TenantPins:
    pins: int = 0          # pins its leases hold, a block pinned twice counted twice
    nbytes: int = 0        # and the bytes they hold, counted likewise


@dataclasses.dataclass
class Stretch:
    since: float           # its first pin
    unloaded: bool = False  # a pin of it ended without a load


class PinBooks:
    """Each tenant's pins, and each pinned or resting block's stretch (module docstring)."""

    def __init__(self, share: float = PIN_SHARE, max_pins: int = MAX_TENANT_PINS,
                 max_pin: float = MAX_PIN) -> None:
        if not 0 < share <= 1 or max_pins <= 0 or not max_pin > 0:
            raise ValueError(f"bad pin bounds: share {share}, max_pins {max_pins}, max_pin {max_pin}")
        self.share = share
        self.max_pins = max_pins
        self.max_pin = max_pin
        self.tenants: dict[Tenant, TenantPins] = {}   # tenants holding pins
        self.stretches: dict[int, Stretch] = {}       # pinned slot -> its stretch
        self.rest: dict[int, float] = {}              # slot -> not pinned again before then

    def fits(self, tenant: Tenant, budget: int, taken: int, taking: int, nbytes: int) -> bool:
        """Whether ``tenant`` may take one more pin, of ``nbytes``, after
        ``taken`` pins of ``taking`` bytes in this lookup: within its pins and
        its share of ``budget``, or its first pin whatever its size (a tier
        too small for a share to hold a block still serves a load per
        tenant). Always for ``None``."""
        if tenant is None:
            return True
        held = self.tenants.get(tenant, TenantPins())
        if held.pins + taken >= self.max_pins:
            return False
        return held.nbytes + taking + nbytes <= int(budget * self.share) or not held.pins + taken

    def pinnable(self, slot: int, pinned: bool, now: float) -> bool:
        """Whether a block may take a new pin at ``now``: within its stretch's
        ``max_pin`` if pinned, else not resting."""
        if pinned:
            return now - self.stretches[slot].since < self.max_pin
        return now >= self.rest.get(slot, now)

    def pinned(self, tenant: Tenant, slot: int, nbytes: int, first: bool, now: float) -> None:
        """``tenant`` pinned ``slot`` (``first``: its stretch begins)."""
        held = self.tenants.setdefault(tenant, TenantPins())
        held.pins += 1
        held.nbytes += nbytes
        if first:
            self.stretches[slot] = Stretch(now)
            self.rest.pop(slot, None)

    def check_unpin(self, tenant: Tenant, pins: int, nbytes: int) -> None:
        """Raise ``TierSlotState`` unless ``tenant`` holds ``pins`` pins of ``nbytes``."""
        held = self.tenants.get(tenant, TenantPins())
        if held.pins < pins or held.nbytes < nbytes:
            raise TierSlotState(f"tenant {tenant} unpins {pins} pin(s) of {nbytes} bytes with {held.pins} "
                                f"of {held.nbytes}")

    def unpinned(self, tenant: Tenant, slot: int, nbytes: int, last: bool, loaded: bool | None,
                 now: float | None) -> None:
        """A pin of ``tenant`` on ``slot`` ended, ``loaded`` or not (``last``:
        the block has no pin left, its stretch ends). Without ``now`` no rest
        begins (callers with no clock: tests of other rules)."""
        held = self.tenants[tenant]
        held.pins -= 1
        held.nbytes -= nbytes
        if not held.pins:
            del self.tenants[tenant]
        stretch = self.stretches[slot]
        stretch.unloaded |= not loaded
        if last:
            del self.stretches[slot]
            span = 0.0 if now is None else now - stretch.since
            if now is not None and span > 0 and (stretch.unloaded or span >= self.max_pin):
                self.rest[slot] = now + span

    def forget(self, live: Container[int]) -> None:
        """Rests of slots no longer in ``live`` (freed): called when they pile up."""
        self.rest = {slot: t for slot, t in self.rest.items() if slot in live}

    def check(self, pins: dict[int, tuple[int, int]]) -> None:
        """``pins``: slot -> (its pins, its bytes) for every entry. The tenants'
        pins add up to the entries', and exactly the pinned slots have a stretch."""
        require(sum(t.pins for t in self.tenants.values()) == sum(n for n, _ in pins.values()),
                "the tenants' pins are not the entries'")
        require(sum(t.nbytes for t in self.tenants.values()) == sum(n * b for n, b in pins.values()),
                "the tenants' pinned bytes are not the entries'")
        require(all(t.pins > 0 and t.nbytes >= 0 for t in self.tenants.values()), "a tenant with no pin is kept")
        require(set(self.stretches) == {slot for slot, (n, _) in pins.items() if n}, "stretches are not the pins")
