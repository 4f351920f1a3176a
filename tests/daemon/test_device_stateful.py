"""The device pool as a state machine, on real host pages.

Random takes, give-backs and scrubs for a few owners. After every step:
every page is free or held by exactly one owner, created pages never exceed
the budget, and a page handed to an owner never shows another owner's bytes
(invariant 6: pages are zeroed before they move).
"""

import mmap

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvelastic.daemon.devices import Device
from kvelastic.vmm import get_backend

PAGE = 2 << 20
OWNERS = ["a", "b", "c"]


class DeviceMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.device = Device("0", get_backend("host"), 6 * PAGE)
        self.held: dict[int, str] = {}       # page -> owner

    def byte(self, page_id, value=None):
        with mmap.mmap(self.device.pages[page_id].fd, PAGE) as m:
            if value is not None:
                m[0] = value
            return m[0]

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(1, 4))
    def take(self, owner, n):
        room = len(self.device.pool.free) + self.device.pool.creatable()
        got = self.device.take(n, owner)
        if n > room:
            assert got is None
            return
        assert got is not None and len(got) == n and not set(got) & set(self.held)
        for page_id in got:
            assert self.byte(page_id) in (0, OWNERS.index(owner) + 1)   # its own bytes, or zeros
            self.byte(page_id, OWNERS.index(owner) + 1)                   # the owner writes its KV
            self.held[page_id] = owner

    @rule(data=st.data())
    def give_back(self, data):
        if not self.held:
            return
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        for page_id in pages:
            self.device.give_back([page_id], self.held.pop(page_id))

    @rule()
    def scrub(self):
        self.device.scrub_one()

    @invariant()
    def books_balance(self):
        self.device.check(list(self.held), 0)


TestDeviceStateful = DeviceMachine.TestCase
TestDeviceStateful.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
