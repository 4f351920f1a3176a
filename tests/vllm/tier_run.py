"""``weights_run.py`` with kvelastic's tier connector configured, as a user
turns it on (docs/tier.md)::

    --kv-transfer-config '{"kv_connector":"KvelasticTierConnector",
      "kv_connector_module_path":"kvelastic_vllm.tier_connector",
      "kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

``--stall``: ``stalling_tier.py``'s double instead, which pins its blocks
and never fetches them (an engine killed in the middle of a load).

``--multi PATH``: the connector as the first child of vLLM's
``MultiConnector``, vLLM's ``ExampleConnector`` (saving every request's KV
under PATH) the second, as a deployment composes connectors.

Everything else (the engine's settings, the commands it answers) is
``weights_run``'s, so its tokens compare with the stock oracle's
(``run_engine.Stock``)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import weights_run  # first: its exit handler must be installed before vLLM's

TIER_CONNECTOR = {"kv_connector": "KvelasticTierConnector", "kv_connector_module_path": "kvelastic_vllm.tier_connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def multi(path: str) -> dict:
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": path}}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [TIER_CONNECTOR, example]}}


def main() -> None:
    import vllm

    config = TIER_CONNECTOR
    if "--stall" in sys.argv:          # stalling_tier.py: pins, never fetches (killed mid-load)
        sys.argv.remove("--stall")
        config = {**TIER_CONNECTOR, "kv_connector": "StallingTierConnector",
                  "kv_connector_module_path": "stalling_tier"}
    if "--multi" in sys.argv:
        at = sys.argv.index("--multi")
        config = multi(sys.argv[at + 1])
        del sys.argv[at:at + 2]
    original = vllm.LLM

    def llm(*args, **kwargs):
        return original(*args, kv_transfer_config=config, **kwargs)

    vllm.LLM = llm     # weights_run.make_llm imports it at call time
    weights_run.main()


if __name__ == "__main__":
    main()
    weights_run.quick_exit.finish()
