"""Random LoRA adapters for the tiny Llama (``build_tiny_llama``), in PEFT's
format, written without ``peft``.

    write_adapter(tmp_path / "a", model_dir, seed=1)

The adapter targets the attention projections: ``k_proj`` and ``v_proj``
change what vLLM writes to the KV cache, so KV blocks computed under one
adapter are wrong under another (or under none). The low-rank update is
about as large as the base weights (std ``INIT_STD``), so greedy tokens with
the adapter differ clearly from the base model's and from another seed's.

Writing to an existing folder replaces the adapter in place, file by file
(each file atomically): the tests' "adapter rewritten in place".
"""

from __future__ import annotations

import json
import os
import pathlib

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection, as in the HF checkpoint."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q)}


def _replace(path: pathlib.Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_adapter(path: pathlib.Path, model: pathlib.Path, seed: int, rank: int = 8) -> pathlib.Path:
    """Write a LoRA adapter of ``rank`` for the model in ``model`` to the folder
    ``path`` (created, or overwritten): weights random but fixed by ``seed``.
    Returns ``path``."""
    import torch
    from safetensors.torch import save_file

    from kvelastic_tools.vllm_bench.tinymodel import INIT_STD

    path, model = pathlib.Path(path), pathlib.Path(model)
    config = json.loads((model / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    # delta = B @ A (scale lora_alpha / r = 1): each entry sums `rank` products
    # of two N(0, s) draws, so s = sqrt(INIT_STD / sqrt(rank)) gives std INIT_STD.
    std = (INIT_STD / rank**0.5) ** 0.5
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, (n_out, n_in) in _shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * std
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model),
                      "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none",
                      "target_modules": list(TARGETS), "fan_in_fan_out": False, "use_rslora": False}
    path.mkdir(parents=True, exist_ok=True)
    _replace(path / "adapter_model.safetensors", lambda p: save_file(tensors, str(p)))
    _replace(path / "adapter_config.json", lambda p: p.write_text(json.dumps(adapter_config, indent=2)))
    return path
