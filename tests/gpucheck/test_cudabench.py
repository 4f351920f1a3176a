"""Part 4's figures in host mode, run as the kit runs them (a subprocess whose
last line is the JSON): the groups that say what moving memory between
engines costs must exist and make sense even without a GPU, so the first GPU
run spends its minutes on figures, not repairs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    env = dict(os.environ, KVELASTIC_LOG_LEVEL="warning")
    done = subprocess.run([sys.executable, "-m", "kvelastic_tools.gpucheck.cudabench", "host"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_no_group_failed_and_host_mode_stays_quick(figures: dict[str, Any]) -> None:
    errors = {k: v["error"] for k, v in figures.items() if isinstance(v, dict) and "error" in v}
    assert errors == {}
    assert {"arena_vs_raw", "zeroing", "grant", "recycling", "handoff", "devices"} <= set(figures)
    assert 0 < figures["seconds"] < 20


def test_recycling_compares_fresh_and_in_place_and_keeps_fresh_for_isolation(figures: dict[str, Any]) -> None:
    r = figures["recycling"]
    assert r["backend"] == "host" and r["rounds"] >= 1
    for way in ("fresh", "in_place"):
        assert 0 < r[f"{way}_p50_us"] <= r[f"{way}_p99_us"]
    # Fresh is release + create, each timed in the same calls.
    assert r["fresh_p50_us"] >= r["create_p50_us"] > 0
    batched = r["batched_create_per_page_us"]
    assert set(batched) >= {"1", "16"} and all(v > 0 for v in batched.values())
    assert r["batched_zeroed"] is True
    # The point of the group: a descriptor kept by the old owner sees its own
    # bytes after a fresh page, the next owner's after an in-place zero.
    assert r["isolation_fresh"] == "own"
    assert r["isolation_in_place"] == "other"
    assert r["chosen"] == "fresh" and "descriptor" in r["why"]


def test_handoff_is_timed_over_rounds_beside_the_raw_map(figures: dict[str, Any]) -> None:
    h = figures["handoff"]
    assert h["rounds"] == 10 and h["pairs"] == 1 and h["pairs_why"]
    assert 0 < h["handoff_p50_us"] <= h["handoff_p99_us"]
    assert 0 < h["regrant_p50_us"] <= h["regrant_p99_us"]
    assert h["raw_map_p50_us"] == figures["arena_vs_raw"]["raw_map_p50_us"] > 0
    # A reclaim is a round trip through two engines and the daemon: far above one mmap.
    assert h["handoff_over_raw_map_p50"] > 5


def test_devices_are_skipped_with_the_reason(figures: dict[str, Any]) -> None:
    assert figures["devices"] == {"status": "skipped", "why": "no GPU"}


def test_a_grants_calls_are_timed_one_by_one_beside_the_grant(figures: dict[str, Any]) -> None:
    """Where a grant's time goes: each call of it alone, per slab (host pages
    here: the kit's smoke), and what the sum leaves to the protocol, the
    loop and the acknowledgement of the grant end to end."""
    g = figures["grant_phases"]
    assert g["pages_per_slab"] == 1 and g["rounds"] == 10
    assert set(g["per_slab"]) == {"create", "export", "transfer", "import", "map", "teardown"}
    assert all(0 < v["p50_us"] <= v["p99_us"] for v in g["per_slab"].values())
    calls = sum(g["per_slab"][k]["p50_us"] for k in ("create", "export", "transfer", "import", "map"))
    assert g["grant_calls_p50_us"] == round(calls, 1)
    against = g["against_grant"]
    assert against["grant_p50_us"] == figures["grant"]["1_engine"]["grant_p50_us"]
    assert against["protocol_loop_ack_us"] == round(against["grant_p50_us"] - against["calls_p50_us"], 1)
