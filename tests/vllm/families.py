"""Tiny random-weight models of the families vLLM serves, built offline from
transformers configs, for ``test_models.py``.

    path = build_family("gemma3", tmp_path)

The tokenizer is the tiny Llama's (``kvelastic_tools.vllm_bench.tinymodel``);
weights are N(0, 0.5) like it, so greedy decoding walks through varied
tokens, norms sit at their neutral value (Gemma scales by 1 + w, so 0), and
the special tokens' output rows are zero. Each family keeps what makes its
KV cache different: Gemma 3's five sliding-window layers per full one (six
KV cache groups), GPT-OSS's alternating sliding and full layers with
experts, Mistral's and Qwen2's sliding window, Granite 4.0-H's Mamba state.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

STD = 0.5
SEED = 1234
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _configs(tok: Any) -> dict[str, Callable[[], tuple[Any, Any]]]:
    import transformers as t

    common = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, tie_word_embeddings=False, max_position_embeddings=2048)
    small = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, **common)
    return {
        "qwen3": lambda: (t.Qwen3Config(num_hidden_layers=2, **small), t.Qwen3ForCausalLM),
        "gemma3": lambda: (t.Gemma3TextConfig(num_hidden_layers=6, sliding_window=64, query_pre_attn_scalar=32,
                                              sliding_window_pattern=6, **small), t.Gemma3ForCausalLM),
        "mistral-sliding": lambda: (t.MistralConfig(num_hidden_layers=2, sliding_window=64, **small),
                                    t.MistralForCausalLM),
        # vLLM's Qwen2 takes a sliding window on every layer or none (max_window_layers=0: every one).
        "qwen2-sliding": lambda: (t.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                                max_window_layers=0,
                                                **{k: v for k, v in small.items() if k != "head_dim"}),
                                  t.Qwen2ForCausalLM),
        "gpt-oss": lambda: (t.GptOssConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                                           **small), t.GptOssForCausalLM),
        # Multi-head latent attention: a 576-wide latent per token (kv_lora_rank 512 + rope 64, the only
        # width vLLM's MLA takes), so a block's bytes divide no page; every layer dense (no expert runs).
        "deepseek-v2-mla": lambda: (t.DeepseekV2Config(
            num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
            v_head_dim=32, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=64, **common), t.DeepseekV2ForCausalLM),
        "granite-4.0-h": lambda: (t.GraniteMoeHybridConfig(
            num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=0,
            shared_intermediate_size=256, mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16, mamba_n_groups=1,
            mamba_d_conv=4, mamba_expand=2, position_embedding_type="rope", **common), t.GraniteMoeHybridForCausalLM),
        # Qwen3-Next: three gated-delta-net (linear attention) layers per full-attention one, experts.
        "qwen3-next": lambda: (t.Qwen3NextConfig(
            num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, decoder_sparse_step=1, **common), t.Qwen3NextForCausalLM),
    }


FAMILIES = ("qwen3", "gemma3", "mistral-sliding", "qwen2-sliding", "gpt-oss", "deepseek-v2-mla", "granite-4.0-h",
            "qwen3-next")


def build_family(name: str, root: pathlib.Path) -> pathlib.Path:
    """The tiny model of family ``name`` in ``root / name`` (built once)."""
    import torch
    from transformers import AutoTokenizer

    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    path = pathlib.Path(root) / name
    if (path / "config.json").exists():
        return path
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    llama = build_tiny_llama(pathlib.Path(root) / "tokenizer-llama")
    tok = AutoTokenizer.from_pretrained(str(llama))
    config, cls = _configs(tok)[name]()
    torch.manual_seed(SEED)
    model = cls(config).to(torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            if "norm" in pname and pname.endswith("weight"):
                p.fill_(0.0 if name == "gemma3" else 1.0)
            elif pname.endswith(("A_log", "dt_bias", ".D")):       # Mamba's decay terms: small, stable
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * STD)
        head = model.get_output_embeddings().weight
        for tid in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id):
            head[tid].zero_()                # greedy never ends a sequence early
    model.generation_config.do_sample = False
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (llama / f).exists():
            shutil.copy(llama / f, tmp / f)
    tmp.rename(path)
    return path
