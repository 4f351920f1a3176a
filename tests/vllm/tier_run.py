"""``weights_run.py`` with kvelastic's tier connector configured, as a user
turns it on (docs/tier.md)::

    --kv-transfer-config '{"kv_connector":"KvelasticTierConnector",
      "kv_connector_module_path":"kvelastic_vllm.tier_connector",
      "kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

Everything else (the engine's settings, the commands it answers) is
``weights_run``'s, so its tokens compare with the stock oracle's
(``run_engine.Stock``)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import weights_run  # first: its exit handler must be installed before vLLM's

TIER_CONNECTOR = {"kv_connector": "KvelasticTierConnector", "kv_connector_module_path": "kvelastic_vllm.tier_connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def main() -> None:
    import vllm

    original = vllm.LLM

    def llm(*args, **kwargs):
        return original(*args, kv_transfer_config=TIER_CONNECTOR, **kwargs)

    vllm.LLM = llm     # weights_run.make_llm imports it at call time
    weights_run.main()


if __name__ == "__main__":
    main()
    weights_run.quick_exit.finish()
