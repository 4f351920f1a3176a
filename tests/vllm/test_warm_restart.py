"""An engine's prefix cache outlives it: killed with SIGKILL or shut down,
the next engine of its namespace starts warm. Real vLLM (CPU build) through
the plugin, one process per engine life, a real daemon.

One chain of engine lives on one daemon, each step checked against stock
vLLM's greedy tokens (the same script with the plugin off):
kill -9 -> restart (warm) -> graceful exit -> restart (warm) -> killed in
the middle of a step -> restart: nothing of that step adopted; then an engine
of the same folder with changed weights adopts nothing. That another tenant
salt or another model is another namespace is ``test_identity.py``'s (an
engine adopts only its namespace's blocks: ``tests/daemon/test_orphan_cache.py``).
"""

import pathlib

import pytest

pytest.importorskip("vllm")

from tests.daemon_proc import wait_for
from tests.vllm import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
WARM_SHARE = 0.9       # the bar: >= 90% of the hits before the restart


class Engine(run_engine.Engine):
    """``kvelastic_tools.vllm_bench.warm_run`` (the script ``bench warm`` runs) in its own process."""

    script = ["-m", "kvelastic_tools.vllm_bench.warm_run"]

    def __init__(self, model, daemon, *args: str, **env: str) -> None:
        # In-process: ``poison`` reaches into the model runner (a step killed
        # after its keys reached the daemon, before its KV was written).
        super().__init__(model, daemon, *args, in_process=True, **env)

    def poison(self) -> int:
        """Dies by its own SIGKILL in the middle of a step."""
        self.proc.stdin.write("poison\n")
        self.proc.stdin.flush()
        return self.proc.wait(timeout=120)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def kept(daemon) -> dict[str, int]:
    """Orphaned cache blocks by namespace."""
    return {o["namespace"]: o["blocks"] for o in daemon.status()["orphans"]}


def until_kept(daemon) -> dict[str, int]:
    return wait_for(lambda: not daemon.status()["engines"] and kept(daemon), timeout=30,
                    what="the engine gone and its cache kept")


def test_the_cache_outlives_its_engine_and_nobody_else_gets_it(daemon_factory, tmp_path):
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tiny-llama")      # its own: the test rewrites its weights
    stock = run_engine.Stock(model)
    expected, unrelated = stock.do("workload")["tokens"], stock.do("unrelated")["tokens"]
    stock.exit()

    # 16 slabs of 2 layers x 2 MiB: room for every engine's own and the kept cache
    daemon = daemon_factory(memory="64MiB", KVELASTIC_IDLE_GRACE="1s")
    first = Engine(model, daemon, KVELASTIC_ENGINE_ID="llm")
    first.do("workload")
    before = first.do("workload")                       # the repeat: what the cache gives
    assert before["tokens"] == expected and before["hits"] > 0
    first.kill()                                        # SIGKILL, idle
    namespace, blocks = next(iter(until_kept(daemon).items()))
    assert blocks > 0

    def warm_restart(how: str) -> Engine:
        engine = Engine(model, daemon, KVELASTIC_ENGINE_ID="llm")
        after = engine.do("workload")                   # the first repeat after the restart
        assert after["tokens"] == expected, how
        assert after["hits"] >= WARM_SHARE * before["hits"], (how, after["hits"], before["hits"])
        stats = engine.do("stats")
        assert stats["adopted_blocks"] > 0 and stats["adopted_hits"] > 0, stats
        print(f"after {how}: {after['hits']:.0f} of {before['hits']:.0f} tokens hit "
              f"({stats['adopted_blocks']} blocks adopted, {stats['adopted_hits']} hit)")
        return engine

    second = warm_restart("kill -9")
    second.exit()                                       # graceful: unregisters
    assert until_kept(daemon).get(namespace)
    assert "engine llm unregistered" in daemon.log()

    third = warm_restart("a graceful restart")
    assert third.poison() == -9                         # killed in the middle of the unrelated prompt's step
    until_kept(daemon)

    fourth = Engine(model, daemon, KVELASTIC_ENGINE_ID="llm")
    mid_step = fourth.do("unrelated")
    assert mid_step["hits"] == 0 and mid_step["tokens"] == unrelated   # nothing of that step adopted
    assert fourth.do("workload")["hits"] >= WARM_SHARE * before["hits"]
    fourth.exit()
    held = until_kept(daemon)[namespace]

    rewrite_weights(model)                              # the same folder, other weights
    stranger = Engine(model, daemon, KVELASTIC_ENGINE_ID="stranger")
    got = stranger.do("workload")
    stats = stranger.do("stats")
    stranger.exit()
    assert stats["adopted_blocks"] == 0 and got["hits"] < before["hits"], (stats, got["hits"])
    assert kept(daemon).get(namespace) == held          # still kept for its own namespace


def rewrite_weights(model: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    [path] = model.glob("*.safetensors")
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, path, metadata={"format": "pt"})
