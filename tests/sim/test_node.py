"""The node-scale simulation (``kvelastic_tools.sim.node``) in its quick form: a
quarter node (8 engines, 20 GiB in 2 MiB pages, a quarter of the load) for a
day compressed into 96 simulated seconds, with the real ``Allocator``, real
``SlabPool``s and the client's ``ReservePolicy``, against the same trace on a
static split. One run (module fixture), many checks of what it did."""

import math
import os

import pytest

from kvelastic import cli
from kvelastic_tools.bench import sim as bench_sim
from kvelastic_tools.sim import traces


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    plot = tmp_path_factory.mktemp("node") / "node-sim.png"
    old = os.environ.get("KVELASTIC_SIM_PLOT")
    os.environ["KVELASTIC_SIM_PLOT"] = str(plot)
    try:
        return bench_sim.run(quick=True, scale="node")
    finally:
        if old is None:
            del os.environ["KVELASTIC_SIM_PLOT"]
        else:
            os.environ["KVELASTIC_SIM_PLOT"] = old


def test_the_run_really_was_a_contended_node(report):
    assert report["node"]["engines"] == 8 and report["trace"]["requests"] > 300
    demand = report["demand"]
    assert demand["grows"] > 100 and demand["needed_reclaim"] > 50     # memory really changed hands
    assert report["slab_moves"] > 100
    assert report["elastic"]["utilisation_held"] > 0.8                  # the budget was full most of the day
    assert report["trace"]["compression"] == 900


def test_the_books_hold_and_every_demand_grow_is_answered(report):
    assert report["invariant_violations"] == 0, report["violation_examples"]
    assert report["demand"]["unanswered"] == 0
    assert report["rejected"] == {}                                     # no message refused (busy, bad journal)
    # An admission waits 0.05 s and takes its answer late; a running request's
    # check waits up to the plugin's 2 s, on that answer if one is on its way:
    # rarely longer (then vLLM preempts), never for most.
    assert report["demand"]["admissions_answered_late"] > 0
    assert report["demand"]["client_timeouts"] <= 0.01 * report["demand"]["grows"]
    assert report["demand"]["handoff_latency_s"]["max"] < 2.0
    assert report["status_slab_moves"] == report["slab_moves"]           # status() reports what the books say


def test_elastic_memory_does_at_least_as_well_as_a_static_split(report):
    elastic, static = report["elastic"], report["static"]
    assert elastic["requests"] == static["requests"]                     # the same trace
    assert elastic["utilisation_live"] >= static["utilisation_live"]
    assert elastic["ratio_live_vs_oracle"] >= 0.9
    assert elastic["served_in_day"] >= static["served_in_day"]
    assert elastic["queue_delay_s"]["p99"] <= static["queue_delay_s"]["p99"]
    assert elastic["preemptions"] <= static["preemptions"]


def test_an_idle_engines_reserve_decays_and_its_cache_yields(report):
    office = report["idle_engine"]["office"]                            # idle from 19:00 to 08:00
    assert office["quiet_samples"] >= 10
    assert office["max_empty_slabs"] == 0                              # no reserve kept while idle
    assert office["max_slabs_beyond_cached_live"] == 0                  # the daemon books nothing more
    assert office["held_gib_at_last_request"] > 0
    assert office["held_gib_longest_min"] < office["held_gib_at_last_request"]   # its cache went to others


def test_every_slab_moved_served_a_demand(report):
    # A reclaimed slab's pages go to the demand that asked for them; more moves
    # than slabs granted to demand would be memory moved for nobody.
    assert report["slab_moves"] <= report["demand_slabs_granted"]
    assert report["moves_per_1000_requests"] < 20_000


def test_the_allocator_keeps_up_with_the_node(report):
    alloc = report["allocator"]
    assert alloc["decisions"] > 10_000
    assert alloc["headroom"] >= 2.0
    assert alloc["headroom_busiest_second"] >= 1.5


def test_no_thrash(report):
    assert report["thrash"] == 0, report["thrash_examples"]


def test_the_plot_is_written(report):
    path = report["plot"]
    assert os.path.getsize(path) > 10_000
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_slab_geometries_hold_whole_blocks():
    for spec in traces.NODE:
        m = spec.model
        assert m.blocks_per_slab * m.block_bytes == m.pages_per_worker * traces.PAGE
        assert 8 << 20 <= m.slab_bytes <= 32 << 20


def test_the_trace_is_seeded_and_follows_the_office_hours():
    a, b = traces.generate(7, 96.0, load=0.25), traces.generate(7, 96.0, load=0.25)
    assert [(r.arrival, r.prompt, r.output) for r in a.requests] == [(r.arrival, r.prompt, r.output)
                                                                      for r in b.requests]
    office = next(i for i, s in enumerate(a.specs) if s.name == "office")
    [(start, end)] = a.idle_windows()[office]
    assert math.isclose(end - start, 96.0 * 13 / 24)
    assert not [r for r in a.requests if r.engine == office and start <= r.arrival < end]
    assert [r for r in a.requests if r.engine == office]


def test_scale_is_for_the_sim_benchmark_only(capsys):
    assert cli.main(["bench", "core", "--scale", "node", "--json"]) == 2
    assert "--scale" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "sim", "--scale", "node", "--quick"])
    assert args.scale == "node" and args.quick
    assert cli.build_parser().parse_args(["bench", "sim"]).scale is None


# ------------------------------------------------ the daemon's free pages at node scale
def _reference_usable(free: dict, owner: str, n: int) -> int:
    """PagePool as it was: a scan of every free page."""
    count = 0
    for page_owner in free.values():
        if page_owner == owner or page_owner == "":
            count += 1
            if count == n:
                break
    return count


def test_free_pages_index_hands_out_what_a_scan_would():
    import random

    from kvelastic.daemon.state import PagePool

    rng = random.Random(3)
    pool, ref, next_page = PagePool(10_000), {}, 0
    for _ in range(5000):
        op, owner, n = rng.random(), rng.choice(["a\0x", "b\0x", "c\0y"]), rng.randint(1, 8)
        if op < 0.3:                                   # pages created (clean)
            for page in range(next_page, next_page + n):
                pool.free[page] = ref[page] = ""
            next_page += n
        elif op < 0.55:                                # a slab's pages taken
            assert pool.usable(owner, n) == _reference_usable(ref, owner, n)
            if pool.usable(owner, n) == n:
                want = [pg for pg, o in ref.items() if o == owner][:n]
                want += [pg for pg, o in ref.items() if o == ""][:n - len(want)]
                assert pool.take(n, owner) == want
                for page in want:
                    del ref[page]
        elif op < 0.65:                                # stale pages released for the budget
            want = [pg for pg, o in ref.items() if o][:n]
            assert pool.take_stale(n) == want
            for page in want:
                del ref[page]
        elif op < 0.75 and ref:                        # the allocator's own deletes (_release_stale)
            page = rng.choice(list(ref))
            del pool.free[page], ref[page]
        else:                                          # a slab unmapped: its pages back, tagged
            pages = list(range(next_page, next_page + n))
            next_page += n
            pool.put_back(pages, owner)
            ref.update(dict.fromkeys(pages, owner))
        assert list(pool.free.items()) == list(ref.items()) and len(pool.free) == len(ref)


def test_finding_an_owners_free_pages_does_not_scan_the_device():
    import time

    from kvelastic.daemon.state import PagePool

    pool = PagePool(40_960)
    pool.put_back(list(range(40_000)), "other\0ns")   # a node's worth of another engine's free pages
    pool.put_back([50_000, 50_001], "me\0ns")
    start = time.perf_counter()
    for _ in range(2000):
        assert pool.usable("me\0ns", 8) == 2
    assert time.perf_counter() - start < 0.2          # a scan: ~1 ms a call, 2 s in all
    assert pool.take(2, "me\0ns") == [50_000, 50_001]
    assert pool.take_stale(3) == [0, 1, 2]
