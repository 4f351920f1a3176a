"""A router scores a prefix held only in the node's tier, with real vLLM.

A real daemon with a tier, one real vLLM engine (CPU build, tiny model)
through the plugin with vLLM's KV events on (so each cached key carries its
label) and Dynamo's indexer (``dynamo_indexer.py``) registered for the
daemon's tier stream as a worker of its own. The engine serves the shared
prompt workload and exits; its kept cache expires into the tier; the
indexer then matches the workload's prompts on that worker's disk tier
(none on a device), every full block of each prompt; an engine with the tier connector then loads those blocks back."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("vllm")

from kvelastic_tools.vllm_bench.dynamo_indexer import DynamoIndexer, available
from kvelastic_tools.vllm_bench.warm_run import QUESTIONS, SYSTEM
from tests.daemon_proc import short_dir, wait_for
from tests.vllm import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32          # weights_run's block size
TIER_WORKER = 7


class EventsEngine(run_engine.Engine):
    script = [str(pathlib.Path(__file__).resolve().parent / "tier_events_run.py")]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_the_indexer_scores_a_prefix_held_only_in_the_tier(daemon_factory, tiny_model, tmp_path):
    why = available()
    if why:
        pytest.skip(why)
    from transformers import AutoTokenizer

    folder = short_dir(tmp_path) / "tier"
    folder.mkdir(mode=0o700)
    daemon = daemon_factory(memory="64MiB", KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="256MiB",
                            KVELASTIC_ORPHAN_CACHE_TTL="1s")
    indexer = DynamoIndexer(short_dir(tmp_path) / "indexer.log").start()
    try:
        endpoint = f"ipc://{daemon.socket}.kv-tier"
        indexer.register(TIER_WORKER, endpoint, "tiny", BLOCK, replay_endpoint=endpoint + "-replay")
        path = " " + endpoint.removeprefix("ipc://")

        def subscribed() -> bool:
            with open(f"/proc/{indexer.proc.pid}/net/unix") as table:
                return any(line.rstrip().endswith(path) and line.split()[5] == "03" for line in table)

        wait_for(subscribed, 30, what="the indexer subscribed to the tier stream")

        def tier_match(prompt: list[int]) -> dict:
            status, reply = indexer.query_raw("/query", {"model_name": "tiny", "token_ids": prompt})
            assert status == 200, reply
            return reply.get("instances", {}).get(str(TIER_WORKER), {"gpu": 0, "disk": 0})

        events = f"ipc://{short_dir(tmp_path)}/engine-events"
        first = EventsEngine(tiny_model, daemon, KVELASTIC_ENGINE_ID="first", KVR_EVENTS=events)
        first.do("workload")
        first.exit()
        tier = wait_for(lambda: not daemon.status()["engines"] and not daemon.status().get("orphans")
                        and daemon.status()["tier"], timeout=60, what="the kept cache demoted")
        assert tier["blocks"] > 0

        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
        prompts = [tokenizer(SYSTEM + q).input_ids for q in QUESTIONS]
        wait_for(lambda: tier_match(prompts[0])["disk"] >= BLOCK, timeout=10, what="the indexer scores the tier")
        for prompt in prompts:
            match = tier_match(prompt)
            assert match["gpu"] == 0 and match["disk"] % BLOCK == 0, match
            assert match["disk"] == len(prompt) // BLOCK * BLOCK, (match, len(prompt))    # every full block
        print(f"tier: {tier['blocks']} block(s); the indexer's tier worker matches "
              f"{[tier_match(p)['disk'] for p in prompts]} tokens of prompts of {[len(p) for p in prompts]}")
        assert tier_match(tokenizer("Something else entirely, " * 8).input_ids)["disk"] == 0

        second = EventsEngine(tiny_model, daemon, KVELASTIC_ENGINE_ID="second",
                              KVR_EVENTS=f"ipc://{short_dir(tmp_path)}/second-events")
        second.do("workload")
        second.exit()
        promoted = daemon.status()["tier"]["counters"]["promotions"]
        print(f"tier: {promoted} block(s) promoted by the next engine")
        assert promoted > 0
    finally:
        indexer.stop()
