"""The kept cache is never wrong, whatever the deployment does between runs:
weights updated in memory (as RL frameworks do), a LoRA adapter rewritten in
place, an invalidation with no engine running. Real vLLM (CPU build) through
the plugin and a real daemon, each engine in its own process
(``weights_run.py``), every completion compared with stock vLLM's greedy
tokens on the same inputs. The weights and adapters are random with enough
variance that the old and new tokens differ, and the tests assert they do.
"""

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tests.daemon_proc import wait_for
from tests.vllm.adapters import write_adapter
from tests.vllm.run_engine import Engine, Stock

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
def stock(model, *commands: str, args: tuple[str, ...] = ()) -> list[dict]:
    engine = Stock(model, *args)
    out = [engine.do(c) for c in commands]
    engine.exit()
    return out


def kept(daemon) -> dict[str, int]:
    return {o["namespace"]: o["blocks"] for o in daemon.status()["orphans"]}


def until_kept(daemon) -> dict[str, int]:
    return wait_for(lambda: not daemon.status()["engines"] and kept(daemon), timeout=30,
                    what="the engine gone and its cache kept")


def differ(a: list[list[int]], b: list[list[int]]) -> int:
    """Completions that differ between two runs of the workload."""
    return sum(x != y for x, y in zip(a, b))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("weights") / "tiny-llama")


def test_weights_updated_in_memory_never_reach_the_checkpoints_engines(daemon_factory, model):
    """Two engine lives: an RL engine whose weights a worker extension
    updates (its cache is never kept), then an engine of the checkpoint (cold,
    as stock; its own cache is kept, and an invalidation with no engine
    running drops it). That a kept cache makes the next engine warm is
    ``test_warm_restart.py``'s; an engine adopts only kept blocks
    (``tests/daemon/test_orphan_cache.py``), so "kept is empty" is "the next
    engine starts cold"."""
    base, _, updated, updated_again = stock(model, "workload", "update 7", "workload", "workload")
    assert differ(base["tokens"], updated["tokens"]) == len(base["tokens"])   # the update changes every completion
    assert updated_again["tokens"] == updated["tokens"] and updated_again["hits"] > 0

    daemon = daemon_factory(memory="64MiB", KVELASTIC_IDLE_GRACE="1s")
    rl = Engine(model, daemon, KVELASTIC_ENGINE_ID="rl")
    assert rl.do("workload")["tokens"] == base["tokens"]
    rl.do("update 7")                                   # a worker extension loads weights, then the reset
    after = rl.do("workload")
    again = rl.do("workload")                           # its own cache after the reset works as stock's
    assert after["tokens"] == updated["tokens"] and again["tokens"] == updated["tokens"]
    assert again["hits"] == updated_again["hits"]
    entry = next(e for e in daemon.status()["engines"] if e["engine_id"] == "rl")
    assert entry["private"] and "~" in entry["namespace"]
    rl.exit()                                           # graceful: it would leave its cache, were it kept
    wait_for(lambda: not daemon.status()["engines"], timeout=30, what="rl gone")
    assert kept(daemon) == {}                           # nothing of the updated engine is kept
    assert "weights may have changed (collective_rpc kvelastic_update_kv_weights)" in daemon.log()

    fresh = Engine(model, daemon, KVELASTIC_ENGINE_ID="rl")   # the same id, from the checkpoint on disk
    first = fresh.do("workload")
    assert first["tokens"] == base["tokens"] and first["hits"] == base["hits"]
    assert fresh.do("stats")["adopted_blocks"] == 0
    fresh.exit()
    namespace, blocks = next(iter(until_kept(daemon).items()))
    assert blocks > 0 and "~" not in namespace          # the checkpoint's engine: its cache is kept

    # Invalidation reaches the kept cache with no engine running.
    out = subprocess.run([sys.executable, "-m", "kvelastic", "invalidate", namespace], env=daemon.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "0 running engine(s)" in out.stdout, out.stdout + out.stderr
    assert kept(daemon) == {}


def test_lora_adapters_never_share_blocks_and_a_rewritten_one_never_meets_its_old_blocks(
        daemon_factory, model, tmp_path):
    """Two engine lives over adapters ``a`` and ``k``. The first runs requests
    of both adapters and of none side by side: stock's tokens and hits for
    each, so no block of one adapter serves another. Then ``a`` is retrained
    and written over its folder (same name, same path, other weights): the
    second engine gets stock's tokens for it, as cold as stock's first run,
    while ``k``, unchanged, starts warm from the first engine's kept cache
    (the control: kept cache works for LoRA)."""
    a, k = write_adapter(tmp_path / "a", model, seed=1), write_adapter(tmp_path / "k", model, seed=3)
    commands = ["workload", f"lora a {a}", f"lora k {k}", f"lora a {a}", "workload"]
    expected = stock(model, *commands, args=("--lora",))
    assert differ(expected[1]["tokens"], expected[2]["tokens"]) == len(expected[1]["tokens"])
    assert differ(expected[0]["tokens"], expected[1]["tokens"]) == len(expected[0]["tokens"])
    write_adapter(a, model, seed=2)                     # retrained, written over the same folder
    new, = stock(model, f"lora a {a}", args=("--lora",))
    assert differ(expected[1]["tokens"], new["tokens"]) == len(new["tokens"])

    write_adapter(a, model, seed=1)
    daemon = daemon_factory(memory="64MiB", KVELASTIC_IDLE_GRACE="1s")
    first = Engine(model, daemon, "--lora", KVELASTIC_ENGINE_ID="lora")
    got = [first.do(c) for c in commands]
    first.exit()
    assert [(r["tokens"], r["hits"]) for r in got] == [(r["tokens"], r["hits"]) for r in expected]
    until_kept(daemon)

    write_adapter(a, model, seed=2)                     # same name, same path, other weights
    second = Engine(model, daemon, "--lora", KVELASTIC_ENGINE_ID="lora")
    rewritten = second.do(f"lora a {a}")
    assert rewritten["tokens"] == new["tokens"] and rewritten["hits"] == new["hits"]   # as cold as stock's
    same = second.do(f"lora k {k}")
    assert same["tokens"] == expected[2]["tokens"] and same["hits"] > expected[2]["hits"]   # warm: kept
    assert second.do("stats")["adopted_blocks"] > 0
    second.exit()
