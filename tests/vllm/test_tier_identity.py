"""Identity holds in the node's tier, with real vLLM (CPU
build, its default layout) and a real daemon: blocks demoted by an engine
of a checkpoint are loaded back only by requests that would have computed
the same KV. A request under a LoRA adapter, an engine whose weights were
updated in memory (diverged), and an engine of other weights in the same
folder hit nothing in the tier and get stock vLLM's tokens; the same
engine's plain requests do hit it (the control: the connector works
there). The tier is in host memory above the disk, its blocks on both.
Another tenant is ``test_tier.py``'s."""

import pytest

pytest.importorskip("vllm")

from tests.vllm.adapters import write_adapter
from tests.vllm.run_engine import Stock
from tests.vllm.test_tier import TierEngine, counters, served_and_demoted, settled, tier_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tier-identity") / "tiny-llama")   # its own: rewritten below


def rewrite_weights(model) -> None:
    """Other weights in the same folder, under the same name: every layer's
    k/v projections scaled (so every KV entry differs, and greedy tokens too)."""
    from safetensors.torch import load_file, save_file

    [path] = model.glob("*.safetensors")
    tensors = load_file(path)
    for name in tensors:
        if "k_proj" in name or "v_proj" in name:
            tensors[name] = tensors[name] * -1.5
    save_file(tensors, path, metadata={"format": "pt"})


def stock(model, *commands: str, args: tuple[str, ...] = ()) -> list[dict]:
    engine = Stock(model, *args)
    out = [engine.do(c) for c in commands]
    engine.exit()
    return out


def test_lora_diverged_and_other_weights_never_meet_the_tiers_blocks(daemon_factory, model, tmp_path):
    adapter = write_adapter(tmp_path / "a", model, seed=1)
    base, lora, _, updated = stock(model, "workload", f"lora a {adapter}", "update 7", "workload", args=("--lora",))
    assert lora["tokens"] != base["tokens"] and updated["tokens"] != base["tokens"]   # each changes the KV

    daemon, _ = tier_daemon(daemon_factory, tmp_path, "host+disk")    # identity is the index's, whatever the medium
    first = served_and_demoted(model, daemon, "--lora")
    assert first["tokens"] == base["tokens"] and first["tier"]["blocks"] > 0

    probe = TierEngine(model, daemon, "--lora", KVELASTIC_ENGINE_ID="probe")
    lookups, hits = counters(daemon)["lookups"], counters(daemon)["hit_blocks"]
    assert probe.do(f"lora a {adapter}")["tokens"] == lora["tokens"]
    assert counters(daemon)["hit_blocks"] == hits                       # the adapter's keys are not the base's
    assert counters(daemon)["lookups"] > lookups                        # ... though it looked
    assert probe.do("workload")["tokens"] == base["tokens"]
    after_control = counters(daemon)
    assert after_control["hit_blocks"] > hits and after_control["promotions"] > 0     # the control: base requests hit
    assert probe.do("update 7")["ok"]                                   # weights pushed in memory: diverged
    assert probe.do("workload")["tokens"] == updated["tokens"]
    assert counters(daemon)["hit_blocks"] == after_control["hit_blocks"]
    assert counters(daemon)["promotions"] == after_control["promotions"]
    probe.exit()
    settled(daemon)

    rewrite_weights(model)                                              # the same folder, other weights
    other, = stock(model, "workload")
    assert other["tokens"] != base["tokens"]
    hits = counters(daemon)["hit_blocks"]
    stranger = TierEngine(model, daemon, KVELASTIC_ENGINE_ID="stranger")
    assert stranger.do("workload")["tokens"] == other["tokens"]
    assert counters(daemon)["hit_blocks"] == hits
    stranger.exit()
