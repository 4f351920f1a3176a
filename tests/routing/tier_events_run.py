"""``tests/vllm/tier_run.py`` (``weights_run.py`` with kvelastic's tier
connector) with vLLM's KV events on, publishing on ``$KVR_EVENTS`` (an
``ipc://`` endpoint): what gives each cached key its label, and so what the
daemon republishes when the block reaches the tier."""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "vllm"))

import weights_run  # first: its exit handler must be installed before vLLM's
from tier_run import TIER_CONNECTOR


def main() -> None:
    import vllm

    original = vllm.LLM
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": os.environ["KVR_EVENTS"],
              "topic": "kv@engine@tiny"}

    def llm(*args, **kwargs):
        return original(*args, kv_transfer_config=TIER_CONNECTOR, kv_events_config=events, **kwargs)

    vllm.LLM = llm     # weights_run.make_llm imports it at call time
    weights_run.main()


if __name__ == "__main__":
    main()
    weights_run.quick_exit.finish()
