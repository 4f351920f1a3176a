"""Page ownership as a state machine: the real allocator on real host pages.

Three engines (no workers: a slab is granted as soon as its pages exist) grow
and return at random; a minimal loop performs the allocator's page effects on
a real ``Device``. After every step: the books balance (every page is free or
in exactly one slab, within the budget), the device's handles match the
books, and a page an engine receives never shows another engine's bytes
(invariant 6: a page that changes engine is a fresh page).
"""

import mmap

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon.allocator import Allocator
from kvelastic.daemon.devices import Device
from kvelastic.vmm import get_backend

PAGE = 2 << 20
ENGINES = ["a", "b", "c"]


class PageMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.device = Device("0", get_backend("host"), 6 * PAGE)
        self.alloc = Allocator({"0": self.device.budget_pages}, PAGE, events=False)
        self.now = 0.0
        self.granted: dict[str, set[int]] = {e: set() for e in ENGINES}
        for i, engine in enumerate(ENGINES):
            self.run(self.alloc.handle(engine.encode(), p.RegisterEngine(
                version=p.PROTOCOL_VERSION, engine_id=engine, pid=100 + i, namespace="ns", page_size=PAGE,
                pages_per_worker=1, num_workers=0, blocks_per_slab=4, block_bytes=PAGE // 4), self.now))

    def run(self, effects):
        """The loop's part: pages created and released for real; grants recorded."""
        replies = []
        while effects:
            e = effects.pop(0)
            if isinstance(e, fx.CreatePages):
                ids = self.alloc.new_page_ids(e.count)
                effects += self.alloc.pages_created(e.device, e.count, self.device.create(ids), self.now)
            elif isinstance(e, fx.ReleasePages):
                self.device.release(e.pages)
            elif isinstance(e, fx.Send):
                replies.append(e.msg)
        return replies

    def byte(self, page_id, value=None):
        with mmap.mmap(self.device.pages[page_id].fd, PAGE) as m:
            if value is not None:
                m[0] = value
            return m[0]

    def pages_of(self, engine, slab_id):
        return self.alloc.engines[engine].slabs[slab_id].pages

    @rule(engine=st.sampled_from(ENGINES), n=st.integers(1, 3))
    def grow(self, engine, n):
        self.now += 0.01
        [reply] = [r for r in self.run(self.alloc.handle(engine.encode(), p.Grow(engine_id=engine, slabs=n,
                                                                                  req_id=1), self.now))
                   if isinstance(r, p.Granted)]
        mark = ENGINES.index(engine) + 1
        for slab_id in reply.slabs:
            for page_id in self.pages_of(engine, slab_id):
                assert self.byte(page_id) in (0, mark), "a page shows another engine's bytes"
                self.byte(page_id, mark)                              # the engine writes its KV
            self.granted[engine].add(slab_id)

    @rule(data=st.data())
    def give_back(self, data):
        engine = data.draw(st.sampled_from(ENGINES))
        if not self.granted[engine]:
            return
        slabs = data.draw(st.lists(st.sampled_from(sorted(self.granted[engine])), min_size=1, unique=True))
        self.now += 0.01
        replies = self.run(self.alloc.handle(engine.encode(), p.Return(engine_id=engine, slabs=slabs, req_id=2),
                                             self.now))
        assert [type(r) for r in replies] == [p.Ok]
        self.granted[engine] -= set(slabs)

    @rule()
    def tick(self):
        self.now += 0.1
        for engine in ENGINES:                                        # alive: idle pages of others go
            self.run(self.alloc.handle(engine.encode(), p.Heartbeat(engine_id=engine), self.now))
        self.run(self.alloc.tick(self.now))

    @invariant()
    def books_balance(self):
        self.alloc.check()
        held = {pg for e in self.alloc.engines.values() for s in e.slabs.values() for pg in s.pages}
        assert set(self.device.pages) == held | set(self.alloc.pools["0"].free)

    @invariant()
    def engines_hold_what_they_were_granted(self):
        for engine in ENGINES:
            assert set(self.alloc.engines[engine].slabs) == self.granted[engine]


TestPageOwnership = PageMachine.TestCase
TestPageOwnership.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
