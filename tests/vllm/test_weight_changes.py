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
from tests.vllm.run_engine import Engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
def stock(model, *commands: str, args: tuple[str, ...] = ()) -> list[dict]:
    engine = Engine(model, None, *args)
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
    from kvelastic_vllm.bench.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("weights") / "tiny-llama")


def test_weights_updated_in_memory_never_reach_the_checkpoints_engines(daemon_factory, model):
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
    assert blocks > 0 and "~" not in namespace

    # Control: without an update in between, the next engine does start warm.
    warm = Engine(model, daemon, KVELASTIC_ENGINE_ID="rl")
    repeat = warm.do("workload")
    assert repeat["tokens"] == base["tokens"] and repeat["hits"] > 0
    assert warm.do("stats")["adopted_blocks"] > 0
    warm.exit()
    until_kept(daemon)

    # Invalidation reaches the kept cache with no engine running.
    out = subprocess.run([sys.executable, "-m", "kvelastic", "invalidate", namespace], env=daemon.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "0 running engine(s)" in out.stdout, out.stdout + out.stderr
    assert kept(daemon) == {}
    cold = Engine(model, daemon, KVELASTIC_ENGINE_ID="rl")
    got = cold.do("workload")
    assert got["tokens"] == base["tokens"] and got["hits"] == base["hits"]  # as cold as stock's first run
    assert cold.do("stats")["adopted_blocks"] == 0
    cold.exit()


def test_a_lora_adapter_rewritten_in_place_never_meets_its_old_blocks(daemon_factory, model, tmp_path):
    adapter = tmp_path / "adapter"
    write_adapter(adapter, model, seed=1)
    old, = stock(model, f"lora a {adapter}", args=("--lora",))
    write_adapter(adapter, model, seed=2)                   # retrained, written over the same folder
    new, = stock(model, f"lora a {adapter}", args=("--lora",))
    assert differ(old["tokens"], new["tokens"]) == len(old["tokens"])

    write_adapter(adapter, model, seed=1)
    daemon = daemon_factory(memory="64MiB", KVELASTIC_IDLE_GRACE="1s")
    first = Engine(model, daemon, "--lora", KVELASTIC_ENGINE_ID="lora")
    assert first.do(f"lora a {adapter}")["tokens"] == old["tokens"]
    first.exit()
    until_kept(daemon)

    # The same adapter content after a restart: its blocks still match (kept cache works for LoRA).
    second = Engine(model, daemon, "--lora", KVELASTIC_ENGINE_ID="lora")
    same = second.do(f"lora a {adapter}")
    assert same["tokens"] == old["tokens"] and same["hits"] > old["hits"]   # more than a cold run's own sharing
    second.exit()
    until_kept(daemon)

    write_adapter(adapter, model, seed=2)                   # same name, same path, other weights
    third = Engine(model, daemon, "--lora", KVELASTIC_ENGINE_ID="lora")
    got = third.do(f"lora a {adapter}")
    assert got["tokens"] == new["tokens"] and got["hits"] == new["hits"]     # as cold as stock's first run
    third.exit()


def test_two_adapters_in_one_engine_never_share_blocks(daemon_factory, model, tmp_path):
    """Requests of two adapters (and of none) side by side: stock's tokens and
    hits for each, so no block of one adapter serves another."""
    one, two = write_adapter(tmp_path / "one", model, seed=3), write_adapter(tmp_path / "two", model, seed=4)
    commands = ["workload", f"lora one {one}", f"lora two {two}", f"lora one {one}", "workload"]
    expected = stock(model, *commands, args=("--lora",))
    assert differ(expected[1]["tokens"], expected[2]["tokens"]) == len(expected[1]["tokens"])
    assert differ(expected[0]["tokens"], expected[1]["tokens"]) == len(expected[0]["tokens"])

    daemon = daemon_factory(memory="64MiB")
    engine = Engine(model, daemon, "--lora", KVELASTIC_ENGINE_ID="two-adapters")
    got = [engine.do(c) for c in commands]
    engine.exit()
    assert [(r["tokens"], r["hits"]) for r in got] == [(r["tokens"], r["hits"]) for r in expected]
