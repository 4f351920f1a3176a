"""``kvelastic router`` in front of real engines on two daemons, with Dynamo's indexer.

A scripted sequence (every user's first turn, then every second, ...; one
request at a time, the indexer caught up before each): the router must send
every request to an engine that really holds the longest cached prefix of
its prompt (the oracle reads each engine's cache from its daemon's journal),
and the KV it claimed must be the hit vLLM then reports.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile

import pytest

from kvelastic_tools.vllm_bench.dynamo_indexer import available
from kvelastic_tools.vllm_bench.kv_events import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_router_sends_each_request_where_its_longest_prefix_is(tmp_path_factory):
    why = available()
    if why:
        pytest.skip(f"Dynamo's indexer cannot run here: {why}")
    from kvelastic_tools.vllm_bench import route_load as load
    from kvelastic_tools.vllm_bench import vllm_serve
    from kvelastic_tools.vllm_bench.route import Cluster
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama
    from tests.vllm.forked import VLLM_FORKED
    from tests.vllm.zygote import launch

    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvrt-", dir="/tmp"))     # short ipc:// paths
    shape = load.Shape(tenants=2, users=4, turns=3, system_len=96, message_len=40, max_tokens=8)
    try:
        cluster_up = Cluster(folder, model, per_node=1, command=VLLM_FORKED, popen=launch).up()
        with cluster_up as cluster:
            with cluster.router("kv") as base:
                def idle_router() -> bool:   # the last reply's load is given back (a scripted sequence: no queue)
                    return not any(json.loads(vllm_serve.http_get(base + "/health"))["load_tokens"].values())

                def oracle(prompt: list[int]) -> tuple[int, frozenset[int]]:
                    wait_for(cluster.settled, 30, "the indexer caught up with every engine")
                    wait_for(idle_router, 10, "the router's load back to 0")
                    return cluster.oracle(prompt)

                turns = load.run_conversations(base, load.make_conversations(shape, seed=5), oracle, concurrent=False)
                assert [t.error for t in turns if t.error] == []
                assert len(turns) == shape.users * shape.turns
                wrong = [(t.user, t.turn, t.engine, sorted(t.oracle_best), t.matched, t.oracle) for t in turns
                         if t.engine not in t.oracle_best or t.matched != t.oracle]
                assert not wrong, f"requests not sent where their longest prefix was: {wrong}"
                assert sum(t.oracle for t in turns) > 0            # later turns really found their history
                assert len({t.engine for t in turns}) == 2         # and new prompts spread over both engines
                # Turn k of a user goes where turn k-1 went: its whole history is there.
                by_user: dict[int, list[int]] = {}
                for t in sorted(turns, key=lambda t: (t.user, t.turn)):
                    by_user.setdefault(t.user, []).append(t.engine)
                assert all(len(set(engines)) == 1 for engines in by_user.values()), by_user
            with cluster.router("kv") as again:     # a restarted router, the same indexer and engines
                assert json.loads(vllm_serve.http_get(again + "/health"))["load_tokens"] is not None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
