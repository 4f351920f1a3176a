"""What users and RL frameworks call, in vLLM's default layout: ``LLM()`` with
its EngineCore in a process of its own, every call below a utility call from
the front end to it (arguments checked against the called method's signature,
``EngineCore._convert_msgspec_args``). Real vLLM (CPU build) through the
plugin and a real daemon, each call's results compared with stock vLLM's for
the same sequence of calls.

- ``collective_rpc`` with positional and keyword arguments through a worker
  extension (how veRL, OpenRLHF, TRL and NeMo-RL push weights);
- vLLM's own weight-update path (``reload_weights`` from a checkpoint on disk);
- ``reset_prefix_cache``, ``sleep(level=1)``/``sleep(level=2)`` and ``wake_up``;
- ``get_metrics`` (every workload's hits and queries are read through it).
The in-memory update guarantee in this layout (an in-memory update never reaches an
engine of the checkpoint) is ``test_weight_changes.py``'s first test, whose
engines run in this layout too (``run_engine.Engine``), forked as on a GPU.
This test's engine is started as vLLM's CPU build starts it (spawned
processes that import vLLM and load the plugin afresh): nothing changed.
"""

import pytest

pytest.importorskip("vllm")

from tests.daemon_proc import wait_for
from tests.vllm.run_engine import Engine, Stock
from tests.vllm.weights_run import write_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("layout") / "tiny-llama")


def stock(model, commands: list[str]) -> list[dict]:
    engine = Stock(model)
    try:
        return [engine.do(c) for c in commands]
    finally:
        engine.exit()


def test_rl_calls_through_the_front_end_give_stock_results(daemon_factory, model, tmp_path):
    other = write_checkpoint(model, tmp_path / "trained", seed=11)
    commands = ["workload", "rpc", "workload", "reset", "workload", "sleep 1", "workload", "sleep 2", "workload",
                f"reload {other}", "workload", "workload"]
    expected = stock(model, commands)
    trained, = stock(other, ["workload"])
    base, reloaded = expected[0]["tokens"], expected[10]["tokens"]
    assert reloaded == trained["tokens"] and sum(a != b for a, b in zip(base, reloaded)) == len(base), \
        "reload_weights must load the trained checkpoint, whose tokens all differ"

    daemon = daemon_factory(memory="64MiB")
    engine = Engine(model, daemon, forked=False, KVELASTIC_ENGINE_ID="rl")
    got = []
    try:
        for command in commands:
            got.append(engine.do(command))
            if command == "rpc":   # the call diverged the engine before it ran
                entry = next(e for e in daemon.status()["engines"] if e["engine_id"] == "rl")
                assert entry["private"] and "~" in entry["namespace"], entry
    finally:
        engine.exit()
    # Each worker got the positional and keyword arguments (3 * 2, "x", 2).
    assert got[1] == expected[1] == {"result": [[6, "x", 2]]}
    for command, mine, theirs in zip(commands, got, expected):
        if command == "workload":
            assert (mine["tokens"], mine["hits"], mine["queries"]) == \
                (theirs["tokens"], theirs["hits"], theirs["queries"]), command
        else:
            assert mine == theirs, command
    assert got[-1]["hits"] > 0       # its own cache works after every reset, as stock's
    log = daemon.log()
    assert "weights may have changed (collective_rpc kvelastic_echo)" in log
    wait_for(lambda: not daemon.status()["engines"], timeout=30, what="rl gone")
    assert daemon.status()["orphans"] == []     # a diverged engine's cache is never kept
