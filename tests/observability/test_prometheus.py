"""Every query of the Grafana dashboard, evaluated by a real Prometheus that
scrapes a real daemon while real engines run a workload with known counts.

The workload (after tests/daemon/test_observe.py), 16 MiB budget = 8 slabs of 2 MiB
of 4 blocks: engine ``a`` grows to 4 slabs (one grow request), allocates 8 blocks
(2 slabs) and gives the 2 idle slabs back after 1 s, caches and frees the 8
blocks, looks up 10 blocks of its prefix (8 hits); engine ``b`` grows by 7 slabs
(one grow request: the 2 free, 4 new, 1 reclaimed from ``a``, which evicts 4
cached blocks), allocates 20 blocks (5 slabs) and gives 2 idle slabs back; a
message from an unknown engine is rejected once. At the end every memory figure
differs: budget 8 slabs, held 6 (a 1, b 5), cached 1 (a's), free 2. The node's
tier holds two blocks of ``a``'s namespace (a former daemon's), which ``a``
looks up with a third key the tier lacks (3 asked for, 2 found) and loads back
(2 promotions).
"""

from __future__ import annotations

import hashlib
import math
import re
import subprocess
import time

import pytest

from kvelastic import protocol as p
from tests.daemon.books import parse_metrics, quiet_status
from tests.daemon.engines import EngineProcess
from tests.daemon_proc import DaemonProcess, MiB, wait_for
from tests.observability.dashboard import (
    expand,
    is_defined,
    label_values,
    load_dashboard,
    metric_definitions,
    panels,
    variables,
)
from tests.observability.prometheus_proc import PrometheusProcess, find

PROMETHEUS, PROMTOOL = find("prometheus"), find("promtool")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus server is not installed "
                       "(/usr/bin/prometheus, Debian package `prometheus`; `make setup` installs it)"),
]

SLAB = 2 * MiB
TIER_BLOCK, TIER_BUDGET = 32 << 10, 8 * MiB          # the tier's blocks hold twice TIER_BLOCK bytes
PREFIX = "kv-prompt-You are a helpful assistant"      # a's block keys are sha256 of f"{PREFIX}-{i}"
ALLOWED_LABELS = {"__name__", "instance", "job", "device", "engine", "namespace", "reason", "state", "bound", "le",
                  "medium"}      # medium: the tier's, host or disk
COUNTERS = ("grants", "returns", "reclaims")


def wait_prom(prom: PrometheusProcess, expr: str, want: float, timeout: float = 10.0) -> None:
    wait_for(lambda: prom.value(expr) == want, timeout=timeout, interval=0.2, what=f"Prometheus: {expr} == {want}")


def engine(daemon: DaemonProcess, engine_id: str) -> dict:
    return {e["engine_id"]: e for e in daemon.status()["engines"]}[engine_id]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Daemon, two engines and Prometheus; the workload; everything the tests need."""
    tmp = tmp_path_factory.mktemp("observability")
    # The node's tier: two blocks a former daemon left, and one file cut short (a torn block).
    from kvelastic.daemon.main import load_hash_secret
    from kvelastic.tier.disk import DiskStore

    daemon = DaemonProcess(tmp, memory="16MiB", KVELASTIC_TIER_DIR=str(tmp / "tier"),
                           KVELASTIC_TIER_SIZE=str(TIER_BUDGET))
    store = DiskStore(tmp / "tier", key=load_hash_secret(daemon.socket))   # the key it finds beside its socket
    for slot in range(3):
        store.write(slot, "llama", b"key-%d" % slot, b"kv" * TIER_BLOCK, cost=1.0)
    store.path(2).write_bytes(store.path(2).read_bytes()[:-1])
    daemon.start()
    engines: list[EngineProcess] = []
    prom = None
    try:
        a = EngineProcess(daemon.socket, "a", grace=1.0, namespace="llama", vllm_keys=True)
        engines.append(a)
        b = EngineProcess(daemon.socket, "b", grace=1.0, namespace="qwen")
        engines.append(b)
        target = f"127.0.0.1:{daemon.metrics_port}"
        prom = PrometheusProcess(tmp, [target], PROMETHEUS).start()
        # The target is up and a first scrape holds both engines with every counter at 0.
        wait_prom(prom, f'up{{job="kvelastic", instance="{target}"}}', 1, timeout=15)
        wait_prom(prom, "kvelastic_engines_connected", 2)

        assert a.do("ensure", n=16)["ok"]                                 # 4 slabs, one grow request
        assert a.do("alloc", n=8)["ok"]                                   # 2 slabs live, 2 idle
        wait_for(lambda: daemon.status()["memory"]["held"] == 2 * SLAB, what="a's idle slabs returned")
        # The grant-latency histogram's series is born with this grant: let
        # Prometheus see it before the next one, so rate() can see that one.
        wait_prom(prom, 'kvelastic_slab_grants_total{engine="a"}', 4)
        wait_prom(prom, "kvelastic_grant_latency_seconds_count", 1)
        a.do("cache", prefix=PREFIX)
        a.do("free")                                                      # 2 slabs of cached blocks
        wait_for(lambda: engine(daemon, "a")["cached_blocks"] == 8 and engine(daemon, "a")["live_blocks"] == 0,
                 what="a's journal: 8 cached blocks, none live")
        assert a.do("lookup", prefix=PREFIX, n=10)["hits"] == 8
        assert b.do("ensure", n=28)["ok"]                                 # 7 slabs, 1 reclaimed from a
        assert b.do("alloc", n=20)["ok"]                                  # 5 slabs live, 2 idle
        wait_for(lambda: engine(daemon, "b")["held_bytes"] == 5 * SLAB, what="b's idle slabs returned")
        daemon.request(p.Grow(engine_id="ghost", slabs=1))                # one rejected message
        pinned = a.send(p.TierLookup(engine_id="a", keys=[b"key-0", b"key-1", b"key-9"]))
        assert isinstance(pinned, p.TierPinned) and pinned.nbytes == [2 * TIER_BLOCK] * 2, pinned
        for block in range(2):                                            # each in one chunk: a promotion
            data = a.send(p.TierFetch(engine_id="a", lease=pinned.lease, block=block, offset=0))
            assert isinstance(data, p.TierData) and data.size == len(data.data) == 2 * TIER_BLOCK, data
        wait_for(lambda: engine(daemon, "a")["stats"].get("lookup_blocks") == 10, what="a's journal")
        status = wait_for(lambda: quiet_status(daemon), what="a quiet daemon")
        by_id = {e["engine_id"]: e for e in status["engines"]}
        assert [by_id["a"][c] for c in COUNTERS] == [4, 2, 1] and [by_id["b"][c] for c in COUNTERS] == [7, 2, 0]
        assert status["memory"] == {"held": 6 * SLAB, "cached": SLAB, "free": 2 * SLAB, "orphaned": 0, "unallocated": 0}

        # Prometheus has scraped the final state, then a few more times.
        wait_prom(prom, 'kvelastic_slab_returns_total{engine="b"}', 2)
        wait_prom(prom, 'kvelastic_prefix_cache_lookup_blocks_total{engine="a"}', 10)
        wait_prom(prom, 'kvelastic_rejected_messages_total{reason="unknown_engine"}', 1)
        wait_prom(prom, "kvelastic_tier_promotions_total", 2)
        time.sleep(2.5)
        assert quiet_status(daemon) == status, "the daemon moved after the workload"
        at = time.time()
        # $__rate_interval: a window reaching back past Prometheus's first scrape,
        # so every counter's first sample in it is the baseline 0.
        window = max(30, math.ceil(at - prom.started) + 10)
        yield dict(daemon=daemon, prom=prom, target=target, status=status, by_id=by_id, at=at,
                   rate_interval=f"{window}s", metrics_text=daemon.metrics(), keys_prefix=PREFIX)
    except BaseException:
        if prom is not None:
            print("--- prometheus log ---\n" + prom.log())
        print("--- daemon log ---\n" + daemon.log())
        raise
    finally:
        for e in engines:
            e.close()
        if prom is not None:
            prom.stop()
        daemon.stop()


def evaluate(run, values: dict) -> dict[tuple[str, str], list[dict]]:
    """Every panel's every query, variables substituted, evaluated at the same instant."""
    prom, out = run["prom"], {}
    for panel in panels(load_dashboard()):
        for t in panel["targets"]:
            expr = expand(t["expr"], values, run["rate_interval"])
            out[(panel["title"], t["refId"])] = prom.query(expr, at=run["at"])
    return out


def by(samples: list[dict], label: str) -> dict[str, float]:
    out = {}
    for s in samples:
        key = s["metric"].get(label, "")
        assert key not in out, (label, samples)
        out[key] = s["value"]
    return out


def single(samples: list[dict]) -> float:
    assert len(samples) == 1, samples
    return samples[0]["value"]


# Kept cache exists only once an engine has left, and this workload's engines
# stay: that query evaluates (a PromQL error fails) and returns nothing here.
# tests/daemon/test_orphan_cache.py checks its series' values after a departure.
NO_DATA_IN_THIS_WORKLOAD = {("Kept cache of departed engines", "A")}


def test_every_panel_query_returns_data_that_agrees_with_the_workload(run):
    status, by_id, target = run["status"], run["by_id"], run["target"]
    results = evaluate(run, {"instance": [target], "engine": ["a", "b"]})
    for (title, ref), samples in results.items():
        if (title, ref) in NO_DATA_IN_THIS_WORKLOAD:
            assert samples == [], (title, ref, samples)
            continue
        assert samples, f"panel {title!r} query {ref} returned no data"
        for s in samples:
            assert math.isfinite(s["value"]), f"panel {title!r} query {ref}: {s}"
            assert s["metric"].get("instance", target) == target, s

    # Selecting "All" (the variables' allValue .*) shows the same thing here.
    assert evaluate(run, {"instance": None, "engine": None}) == results

    assert single(results[("Engines connected", "A")]) == 2 == len(status["engines"])
    memory = {ref: single(results[("Device memory", ref)]) for ref in "ABCD"}
    assert memory == {"A": 16 * MiB, "B": status["memory"]["held"], "C": status["memory"]["cached"],
                      "D": status["memory"]["free"]}
    assert memory == {"A": 8 * SLAB, "B": 6 * SLAB, "C": SLAB, "D": 2 * SLAB}

    held = by(results[("Memory per engine", "A")], "engine")
    assert held == {e: by_id[e]["held_bytes"] for e in "ab"} == {"a": SLAB, "b": 5 * SLAB}
    ns = {s["metric"]["engine"]: s["metric"]["namespace"] for s in results[("Memory per engine", "A")]}
    assert ns == {"a": "llama", "b": "qwen"}
    cached = by(results[("Cached prefix memory per engine", "A")], "engine")
    assert cached == {e: by_id[e]["cached_bytes"] for e in "ab"} == {"a": SLAB, "b": 0}

    # Rates: every counter's samples share timestamps and start at 0 in the window,
    # so Prometheus's extrapolation scales them alike and their ratios are exact.
    slabs = {(c, e): v for c, ref in zip(COUNTERS, "ABC")
             for e, v in by(results[("Slab grants, returns and reclaims per second", ref)], "engine").items()}
    unit = slabs[("grants", "a")] / by_id["a"]["grants"]
    assert unit > 0
    for (counter, engine), rate in slabs.items():
        assert rate == pytest.approx(unit * by_id[engine][counter]), (counter, engine, slabs)
    assert len(slabs) == 6

    hit_rate = by(results[("Prefix-cache hit rate per engine", "A")], "engine")
    assert hit_rate == {"a": pytest.approx(8 / 10)}           # b looked nothing up: no point, not NaN
    assert by_id["a"]["stats"]["hit_tokens"] / by_id["a"]["stats"]["query_tokens"] == 8 / 10

    evictions = by(results[("Prefix-cache evictions by reason", "A")], "reason")
    want = {k[len("evictions_"):]: v for k, v in by_id["a"]["stats"].items() if k.startswith("evictions_")}
    assert want["reclaim"] == 4 and set(evictions) == set(want)
    # Close, not exact: the eviction series appear with a's first journal (the
    # daemon has no eviction counts for an engine before it), not at the baseline
    # scrape, so their samples span a shorter time and extrapolate a little more.
    assert evictions == {r: pytest.approx(unit * n, rel=0.25) for r, n in want.items()}

    # The two blocks found at start, and any of a's cached blocks demoted when b's grow reclaimed them
    # (a's blocks: a quarter of a slab each).
    counters = status["tier"]["counters"]
    tier = {ref: single(results[("Node tier memory", ref)]) for ref in "AB"}
    assert tier == {"A": 2 * 2 * TIER_BLOCK + counters["demotions"] * SLAB // 4, "B": TIER_BUDGET} == \
        {"A": status["tier"]["bytes"], "B": status["tier"]["budget_bytes"]}
    lost = by(results[("Node tier blocks lost per second", "A")], "reason")
    # Every reason has a series.
    assert set(lost) == {"disk_full", "memory_full", "io", "torn", "checksum", "identity", "load", "raced",
                         "unconfirmed", "evicted_share"}
    assert set(lost.values()) == {0.0}          # the torn block was dropped at start: no loss since
    assert status["tier"]["counters"]["failures_torn"] == 1
    assert by(results[("Node tier blocks", "A")], "namespace") == {"llama": 2 + counters["demotions"]} == \
        status["tier"]["namespaces"]
    assert (counters["lookup_blocks"], counters["hit_blocks"], counters["promotions"]) == (3, 2, 2)
    assert single(results[("Node tier hit rate", "A")]) == pytest.approx(2 / 3)
    moved = {ref: single(results[("Node tier demotions and promotions per second", ref)]) for ref in "ABC"}
    # As the grants' rate: every tier series since 0 in the window.
    assert moved == {"A": pytest.approx(unit * counters["demotions"]), "B": pytest.approx(unit * 2), "C": 0.0}
    # Load latency: the two blocks' loads (lookup to last chunk), p50 and p99 within the buckets they fell in.
    load_p50, load_p99 = (single(results[("Node tier load latency", ref)]) for ref in "AB")
    load = status["tier"]["load_seconds"]
    assert sum(load["counts"]) == 2
    first = next(i for i, n in enumerate(load["counts"]) if n)
    last = max(i for i, n in enumerate(load["counts"]) if n)
    lo, hi = ([0.0, *load["buckets"]][first], [*load["buckets"], math.inf][last])
    assert lo <= load_p50 <= load_p99 <= hi, (load_p50, load_p99, lo, hi)

    rejected = by(results[("Rejected messages", "A")], "reason")
    assert {r: v for r, v in rejected.items() if v} == {"unknown_engine": 1}   # every reason has a series

    # Grant latency: both quantiles inside the span of the buckets the two grants fell in.
    m = parse_metrics(run["metrics_text"])
    buckets = sorted((float(dict(lbl)["le"]), v) for (name, lbl), v in m.items()
                     if name == "kvelastic_grant_latency_seconds_bucket")
    total = buckets[-1][1]
    assert total == 2 == m[("kvelastic_grant_latency_seconds_count", frozenset({("device", "0")}))]
    bounds = [0.0] + [le for le, _ in buckets]
    lo = bounds[next(i for i, (_, v) in enumerate(buckets) if v > 0)]
    hi = next(le for le, v in buckets if v == total)
    p50, p99 = (single(results[("Grant latency", ref)]) for ref in "AB")
    assert lo <= p50 <= p99 <= hi, (p50, p99, lo, hi)


def test_engine_variable_filters_the_per_engine_panels(run):
    results = evaluate(run, {"instance": [run["target"]], "engine": ["a"]})
    for title in ("Memory per engine", "Cached prefix memory per engine",
                  "Slab grants, returns and reclaims per second", "Prefix-cache hit rate per engine"):
        for (t, ref), samples in results.items():
            if t == title:
                assert samples and {s["metric"]["engine"] for s in samples} == {"a"}, (title, ref, samples)
    assert by(results[("Memory per engine", "A")], "engine") == {"a": SLAB}
    nothing = evaluate(run, {"instance": ["127.0.0.1:1"], "engine": None})
    assert all(not samples for samples in nothing.values()), "the instance variable does not filter"


def test_raw_series_in_prometheus_equal_the_daemons_books(run):
    prom, by_id, status = run["prom"], run["by_id"], run["status"]
    for engine, e in by_id.items():
        for counter in COUNTERS:
            got = prom.value(f'kvelastic_slab_{counter}_total{{engine="{engine}"}}')
            assert got == e[counter], (engine, counter, got)
        assert prom.value(f'kvelastic_engine_held_bytes{{engine="{engine}"}}') == e["held_bytes"]
    assert prom.value('kvelastic_prefix_cache_lookup_blocks_total{engine="a"}') == 10
    assert prom.value('kvelastic_prefix_cache_hit_blocks_total{engine="a"}') == 8
    stats = by_id["a"]["stats"]
    assert prom.value('kvelastic_prefix_cache_queries_total{engine="a"}') == stats["query_tokens"] > 0
    assert prom.value('kvelastic_prefix_cache_hits_total{engine="a"}') == stats["hit_tokens"] > 0
    assert prom.value('kvelastic_prefix_cache_evictions_total{engine="a", reason="reclaim"}') == 4
    assert prom.value("kvelastic_budget_bytes") == 16 * MiB == status["budget_bytes"]
    assert prom.value("kvelastic_engines_connected") == 2
    assert prom.value('kvelastic_rejected_messages_total{reason="unknown_engine"}') == 1
    assert prom.value("kvelastic_grant_latency_seconds_count") == 2


def test_template_variable_queries(run):
    """``label_values(selector, label)`` as Grafana asks Prometheus for it."""
    prom, target = run["prom"], run["target"]
    found = {}
    for name, var in variables(load_dashboard()).items():
        if var["type"] != "query":
            continue
        selector, label = label_values(var)
        params = {"start": f"{prom.started - 60:.0f}", "end": f"{time.time():.0f}"}
        if selector:
            params["match[]"] = expand(selector, {"instance": [target]}, "1m")
        found[name] = set(prom.api(f"label/{label}/values", **params))
    assert found == {"instance": {target}, "engine": {"a", "b"}}


def test_promtool_check_metrics_is_clean(run):
    assert PROMTOOL, "promtool not installed next to prometheus"
    text = run["daemon"].metrics()
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    report = (out.stdout + out.stderr).strip()
    assert out.returncode == 0 and not report, f"promtool check metrics (exit {out.returncode}):\n{report}"


def test_no_label_carries_a_hash_token_or_prompt(run):
    prom = run["prom"]
    series = prom.api("series", **{"match[]": '{__name__=~"kvelastic_.*"}',
                                   "start": f"{prom.started - 60:.0f}", "end": f"{time.time() + 1:.0f}"})
    assert len(series) > 20
    names = {s["__name__"] for s in series}
    defined = metric_definitions()
    unknown = {n for n in names if not is_defined(n, defined)}
    assert not unknown, f"series not defined in kvelastic/metrics.py: {sorted(unknown)}"
    label_names = set().union(*series)
    assert label_names <= ALLOWED_LABELS, f"unexpected labels: {label_names - ALLOWED_LABELS}"
    # a's cached block keys: sha256 of the prefix's blocks (+ 4-byte group id, vLLM style)
    secrets = [run["keys_prefix"], *(hashlib.sha256(f"{run['keys_prefix']}-{i}".encode()).hexdigest()
                                     for i in range(10))]
    secrets += [s[:16] for s in secrets[1:]]
    for s in series:
        for label, value in s.items():
            assert not re.search(r"[0-9a-fA-F]{16,}", value), f"{label}={value!r} looks like a hash"
            assert not any(secret in value for secret in secrets), f"{label}={value!r} carries a prompt or key"
            assert not re.search(r"prompt|assistant", value, re.I), f"{label}={value!r}"
