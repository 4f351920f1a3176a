"""What makes cached blocks interchangeable: the namespace (weights included)
and the root of vLLM's block hashes, which the plugin seeds from the daemon's
per-namespace secret. Real vLLM (CPU build) through the plugin."""

import hashlib
import hmac
import json
import os
import shutil

import pytest

pytest.importorskip("vllm")

from kvelastic_vllm.identity import namespace_of, weights_fingerprint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_block_hashes_are_rooted_in_the_namespaces_secret_seed(plugin_runs):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    roots = {}
    for name in ("plain", "tuned"):
        namespace = plugin_runs[name]["engine"]["namespace"]
        seed = hmac.new(plugin_runs["hash_secret"], namespace.encode(), hashlib.sha256).hexdigest()
        # what every engine of this namespace on this daemon computes, and nobody without the key
        assert plugin_runs[name]["none_hash"] == sha256(seed).hex()
        roots[name] = plugin_runs[name]["none_hash"]
    assert roots["plain"] != roots["tuned"]                            # another tenant: other hashes
    assert sha256(DEFAULT_NONE_HASH_SEED).hex() not in roots.values()  # not vLLM's public constant


def vllm_config(model: str, **model_settings):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=model, dtype="float32", seed=0, max_model_len=1024,
                                               skip_tokenizer_init=True, **model_settings),
                      cache_config=CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=True))


def test_the_namespace_changes_with_the_weights_and_the_tenant(plugin_runs, tmp_path):
    model = str(tmp_path / "copy")
    shutil.copytree(plugin_runs["model"], model)           # copy2: the same names, sizes and times
    before = weights_fingerprint(model)
    assert before == weights_fingerprint(str(plugin_runs["model"]))
    ns = namespace_of(vllm_config(model), 4096, 2, 1, "")
    assert ns == namespace_of(vllm_config(model), 4096, 2, 1, "") and ns.startswith("copy-")
    assert namespace_of(vllm_config(model), 4096, 2, 1, "tenant-b") != ns
    # The same files run with another rope: the config as vLLM runs it is part of the namespace.
    overridden = namespace_of(vllm_config(model, hf_overrides={"rope_theta": 5000.0}), 4096, 2, 1, "")
    assert overridden != ns
    assert overridden == namespace_of(vllm_config(model, hf_overrides={"rope_theta": 5000.0}), 4096, 2, 1, "")
    # Compiled or eager: other kernels, other KV bytes (the kept cache across modes).
    eager = namespace_of(vllm_config(model, enforce_eager=True), 4096, 2, 1, "")
    assert eager != namespace_of(vllm_config(model, enforce_eager=False), 4096, 2, 1, "")
    assert eager == namespace_of(vllm_config(model, enforce_eager=True), 4096, 2, 1, "")

    [weights] = [f for f in os.listdir(model) if f.endswith(".safetensors")]
    os.utime(os.path.join(model, weights), ns=(1, 1))      # the weights were rewritten
    assert weights_fingerprint(model) != before
    assert namespace_of(vllm_config(model), 4096, 2, 1, "") != ns

    changed = weights_fingerprint(model)
    config = os.path.join(model, "config.json")
    with open(config) as f:
        settings = json.load(f)
    settings["rms_norm_eps"] = 1e-6                         # same files, another model
    with open(config, "w") as f:
        json.dump(settings, f)
    assert weights_fingerprint(model) != changed
