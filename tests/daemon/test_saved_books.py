"""What a new daemon may adopt of the saved books (``saved.py``): only kept
slabs whose every page the keeper holds, named once, on a device it has,
within its budget; lent records held for their engines' claims only when
every page is held and named once in the whole file; everything else
dropped and counted. When the books are written (``saved.Saving``). Pure logic."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvelastic import protocol as p
from kvelastic.daemon import saved
from kvelastic.daemon.orphans import OrphanSlab
from kvelastic.daemon.state import SlabShape

SHAPE = SlabShape("0", 1, 1, 1, 4, 1 << 19, ((0, "0"),))


def slab(pages: list[int], since: float = 0.0, ns: str = "llama", device: str = "0") -> OrphanSlab:
    return OrphanSlab(ns, SHAPE, pages, [device] * len(pages), (p.CachedBlock(0, b"k" * 32, b""),), since, "a")


def test_saved_books_round_trip_with_their_ages():
    kept = [slab([3], since=10.0), slab([5, 6], since=40.0, ns="qwen")]
    books = saved.load(saved.save(kept, next_page=7, now=100.0))
    assert books.next_page == 7
    assert [(s.namespace, s.pages, s.age) for s in books.kept] == [("llama", [3], 90.0), ("qwen", [5, 6], 60.0)]
    out = saved.adopt(books, held={3, 5, 6}, room={"0": 8}, now=500.0)
    assert [(o.namespace, o.pages, o.since) for o in out.kept] == [("llama", [3], 410.0), ("qwen", [5, 6], 440.0)]
    assert out.pages == {"0": [3, 5, 6]} and out.dropped == {}
    assert out.kept[0].cached == kept[0].cached and out.kept[0].shape == SHAPE


@pytest.mark.parametrize("payload", [b"", b"\x90", msgspec.msgpack.encode({"version": 1}),
                                     msgspec.msgpack.encode(saved.SavedBooks(3, 0, [])),
                                     msgspec.msgpack.encode(saved.SavedBooks(1, 0, [], [
                                         saved.SavedLent("a", "ns", -1, b"", 0, "0", [1], ["0"])]))])
def test_books_that_do_not_decode_or_of_another_version_are_refused(payload):
    with pytest.raises(saved.SavedBooksInvalid):
        saved.load(payload)


def test_each_reason_to_drop_a_slab():
    books = saved.load(saved.save([
        slab([1]),                        # adopted
        slab([2]),                        # the keeper lost its page
        slab([7]),                        # a page named twice: both dropped
        slab([7]),
        slab([9]),                        # an id its daemon never handed out
        slab([3], device="1"),            # a device this daemon does not have
        slab([4, 5]),                     # no room left for two pages
    ], next_page=8, now=0.0))
    out = saved.adopt(books, held={1, 3, 4, 5, 7, 9}, room={"0": 2}, now=0.0)
    assert [o.pages for o in out.kept] == [[1]]
    assert out.dropped == {"pages_gone": 1, "malformed": 3, "device_gone": 1, "over_budget": 1}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 20), min_size=1, max_size=4), st.floats(0, 100)), max_size=8),
       st.sets(st.integers(0, 20)), st.integers(0, 12), st.integers(0, 25))
def test_adoption_never_names_a_page_twice_nor_one_not_held_nor_past_the_budget(slabs, held, room, next_page):
    books = saved.load(saved.save([slab(pages, since) for pages, since in slabs], next_page, now=100.0))
    out = saved.adopt(books, held=held, room={"0": room}, now=100.0)
    pages = [pg for o in out.kept for pg in o.pages]
    assert len(pages) == len(set(pages)) <= room
    assert set(pages) <= held and all(pg < next_page for pg in pages)
    assert sorted(pages) == sorted(out.pages.get("0", []))
    assert len(out.kept) + sum(out.dropped.values()) == len(slabs)
    assert [o.since for o in out.kept] == sorted(o.since for o in out.kept)     # oldest first


def test_a_state_file_is_removed_once_its_keeper_is_lost_and_never_written_again(tmp_path):
    """Without a keeper the pages a file names may be gone or re-made: a
    daemon that lost its keeper (even before it wrote anything) removes the
    file its predecessor left and writes no other."""
    from kvelastic.daemon.allocator import Allocator
    from kvelastic.daemon.keeping import PageKeeper
    from kvelastic.daemon.statefile import write_state
    from kvelastic.daemon.succession import Succession

    path = tmp_path / "kv.sock.state"
    write_state(path, saved.save([slab([1])], next_page=2, now=0.0), boot="0" * 36)
    keeper = PageKeeper.__new__(PageKeeper)
    keeper.client = None                                   # lost (``PageKeeper._lost`` detaches it)
    allocator = Allocator({"0": 8}, 2 << 20)
    succession = Succession(str(path), "0" * 36, keeper)
    succession.save(allocator, now=1.0)
    assert not path.exists()
    allocator.orphans.keep(slab([3]))                      # the kept cache moves: still nothing written
    succession.save(allocator, now=2.0)
    assert not path.exists()


def lent(slab_id: int, pages: list[int], engine: str = "a", device: str = "0") -> saved.SavedLent:
    return saved.SavedLent(engine, "llama", -1, saved.token_digest(b"t" * 16), slab_id, "0", pages,
                           [device] * len(pages))


def test_version_1_books_are_still_read_and_have_no_lent_records():
    books = saved.load(msgspec.msgpack.encode(saved.SavedBooks(1, 4, [])))
    assert books.lent == [] and books.next_page == 4


def test_lent_records_are_held_only_when_every_page_is_held_and_named_once():
    books = saved.load(saved.save([slab([1])], next_page=20, now=0.0, lent=[
        lent(0, [2, 3]),                  # held for its engine's claim
        lent(1, [4]),                     # the keeper lost its page
        lent(2, [1]),                     # a page of a kept slab too: both dropped
        lent(3, [5], device="9"),         # a device this daemon does not have
        lent(4, [6, 6]),                  # a page named twice in one record
        lent(5, [30]),                    # an id its daemon never handed out
        lent(6, [7]), lent(6, [8]),       # one slab of one engine twice: both dropped
        lent(0, [10], engine="b"),        # another engine's slab 0: held too
    ]))
    out = saved.adopt(books, held=set(range(40)) - {4}, room={"0": 8}, now=0.0)
    assert out.kept == [] and out.dropped == {"malformed": 1}
    assert [(r.engine_id, r.slab_id) for r in out.lent] == [("a", 0), ("b", 0)]
    assert out.lent_dropped == {"pages_gone": 1, "malformed": 5, "device_gone": 1}
    assert sorted(out.lent_gone) == [("a", 1), ("a", 2), ("a", 3), ("a", 4), ("a", 5), ("a", 6), ("a", 6)]
    assert out.lent_pages() == {"0": [2, 3, 10]}


class Books:
    """What ``saved.Saving`` reads of an allocator."""

    def __init__(self) -> None:
        from kvelastic.daemon.orphans import OrphanCache

        self.orphans = OrphanCache()
        self.next_page = 100
        self.slabs: dict[tuple[str, int], list[int]] = {}
        self.new: set[tuple[str, int]] = set()
        self.changes = 0

    def lend(self, engine: str, slab_id: int, pages: list[int]) -> None:
        self.slabs[(engine, slab_id)] = pages
        self.new.add((engine, slab_id))
        self.changes += 1

    def give_back(self, engine: str, slab_id: int) -> None:
        del self.slabs[(engine, slab_id)]
        self.changes += 1

    def lent_version(self):
        return (self.changes,)

    def lent_new(self):
        for key in self.new:
            if key in self.slabs:
                yield key[0], key[1], self.slabs[key]

    def lent_records(self):
        return [lent(sid, pages, engine=e) for (e, sid), pages in self.slabs.items()]

    def lent_written(self) -> None:
        self.new.clear()


def test_lent_slabs_are_written_coalesced_but_ahead_of_a_page_or_slab_named_otherwise():
    books, saving = Books(), saved.Saving(coalesce=0.25)

    def write(now: float) -> bool:
        if not saving.due(books, now):
            return False
        saved.load(saving.payload(books, now))
        saving.written(books, now)
        return True

    assert write(0.0)                              # the first write
    assert not write(0.01)                         # nothing moved
    books.lend("a", 0, [1, 2])                     # fresh pages, a slab the file does not name: coalesced
    assert not write(0.02)
    assert write(0.3)                              # ... written once the window passed
    books.give_back("a", 0)                        # returned: no hurry (no claim names it)
    assert not write(0.31)
    books.lend("a", 0, [3, 4])                     # slab 0 of a again, other pages: written ahead
    assert write(0.32)
    books.give_back("a", 0)
    books.lend("b", 5, [3])                        # page 3, which the file names under a's slab 0: ahead
    assert write(0.33)
    books.orphans.keep(slab([9]))                  # the kept cache moved: at once, as ever
    assert write(0.34)
    assert not write(0.35)


# ------------------------------------------------ claims (registration.py), in-process
PAGE = 2 << 20
TOKEN = b"s" * 16


def restarted(records: list[saved.SavedLent]):
    """An allocator that took back ``records`` at t=0 (their pages held for claims)."""
    from kvelastic.daemon.allocator import Allocator
    from kvelastic.status_report import RestartStatus

    alloc = Allocator({"0": 8}, PAGE)
    adoption = saved.adopt(saved.load(saved.save([], 20, 0.0, records)), set(range(20)), alloc.room(), 0.0)
    alloc.adopt_kept(adoption, RestartStatus(state_file="ok", lent_held=len(adoption.lent)), now=0.0)
    alloc.check()
    return alloc


def claim(alloc, held: list[int], namespace: str = "llama", token: bytes = TOKEN, mapped: list[int] | None = None,
          now: float = 1.0):
    alloc.peer_opened("a", -1, now, token)
    alloc.handle(b"E", p.RegisterEngine(version=p.PROTOCOL_VERSION, engine_id="a", pid=1, namespace=namespace,
                                        page_size=PAGE, pages_per_worker=1, num_workers=1, blocks_per_slab=4,
                                        block_bytes=1 << 19, held=held, token=token), now)
    alloc.peer_opened("a", 0, now, token)
    out = alloc.handle(b"W", p.RegisterWorker(version=p.PROTOCOL_VERSION, engine_id="a", rank=0, pid=2,
                                              mapped=held if mapped is None else mapped, token=token), now)
    alloc.check()
    return out


def record(slab_id: int, page: int) -> saved.SavedLent:
    return saved.SavedLent("a", "llama", -1, saved.token_digest(TOKEN), slab_id, "0", [page], ["0"])


def test_a_claim_that_matches_takes_its_pages_once_its_workers_confirm():
    alloc = restarted([record(0, 3), record(1, 4), record(5, 9)])
    assert alloc.pools["0"].held_lent == 3 and alloc.pools["0"].creatable() == 5
    effects = claim(alloc, [0, 1])
    engine = alloc.engines["a"]
    assert engine.slabs[0].pages == [3] and engine.slabs[1].pages == [4] and alloc.pools["0"].created == 2
    assert alloc.pools["0"].held_lent == 0 and alloc.pools["0"].adopted == 0
    restart = alloc.status().restart
    assert restart.lent_adopted == 2 and restart.lent_let_go == 1 and restart.lent_unmatched == {}
    assert [e.pages for e in effects if type(e).__name__ == "ReleasePages"] == []   # slab 5's went at registration
    assert [(r.slab_id, r.pages) for r in alloc.lent_records()] == [(0, [3]), (1, [4])]


@pytest.mark.parametrize(("how", "why"), [({"namespace": "qwen"}, "mismatch"), ({"token": b"t" * 16}, "mismatch"),
                                          ({"mapped": []}, "unconfirmed")])
def test_a_claim_that_does_not_match_is_adopted_without_pages_and_counted(how, why):
    alloc = restarted([record(0, 3)])
    claim(alloc, [0], **how)
    slab = alloc.engines["a"].slabs[0]
    assert slab.pages == [] and slab.adopted_pages == 1 and alloc.pools["0"].created == 0
    restart = alloc.status().restart
    assert restart.lent_adopted == 0 and restart.lent_unmatched == {why: 1} and restart.lent_let_go == 1
    assert alloc.registration.held_records() == [] and alloc.pools["0"].held_lent == 0


def test_unclaimed_records_are_let_go_after_the_grace_period_and_a_late_claim_counted():
    from kvelastic.daemon import effects as fx
    from kvelastic.daemon.registration import LENT_GRACE

    alloc = restarted([record(0, 3)])
    assert not [e for e in alloc.tick(LENT_GRACE - 0.5) if isinstance(e, fx.ReleasePages)]
    released = [e for e in alloc.tick(LENT_GRACE + 0.1) if isinstance(e, fx.ReleasePages)]
    assert [e.pages for e in released] == [(3,)] and alloc.pools["0"].held_lent == 0
    claim(alloc, [0], now=LENT_GRACE + 1)
    restart = alloc.status().restart
    assert restart.lent_unmatched == {"late": 1} and restart.lent_let_go == 1 and restart.lent_adopted == 0
