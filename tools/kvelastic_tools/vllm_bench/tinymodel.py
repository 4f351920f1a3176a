"""A tiny random-weight Llama, built offline, for the vLLM benchmarks and tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained in memory
on a generated corpus, the weights are random (seeded, so the model is the
same on every machine), and the result is cached in the directory given.

Usage::

    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama, check_varied_greedy
    path = build_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-llama")
    check_varied_greedy(path)

The weights use a large std (``INIT_STD``) so that greedy decoding walks
through varied tokens instead of repeating one: prefix-cache tests compare
outputs token by token, and a model that always emits the same token would
hide a wrong KV block.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random

# Bump when anything below changes the files written: a cached model with
# another version is rebuilt.
RECIPE_VERSION = 4

VOCAB_SIZE = 512
INIT_STD = 0.5


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32      # vLLM's CPU attention supports head sizes 32, 64, 80, ... (not 16)
    max_pos: int = 2048
    dtype: str = "float32"


TINY = Shape()
# KV as wide as a small real model's (8 KV heads of 64, bf16: 2 KiB per token
# and layer), so that one 2 MiB slab holds about 1,000 tokens and a long
# prompt spans several slabs; positions for 8K-token prompts.
WIDE = Shape(hidden=512, intermediate=512, heads=8, kv_heads=8, head_dim=64, max_pos=8192, dtype="bfloat16")
SEED = 1234

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
EOS_ID = 1  # ids follow the trainer's special_tokens order: <s>=0, </s>=1, <pad>=2
_STAMP = "kvelastic-tiny.json"

_WORDS = (
    "the a an of to in on at for with from by about into over after cache "
    "block page memory token prefix hit miss evict pool arena daemon kernel "
    "request prompt model layer head query key value attention vector "
    "alpha beta gamma delta red green blue cat dog bird fish tree river "
    "stone cloud rain sun moon star one two three four five six seven "
    "eight nine ten run walk jump read write open close start stop fast slow"
).split()


def _corpus(n_lines: int = 2000) -> list[str]:
    rng = random.Random(SEED)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        lines.append(" ".join(words) + rng.choice([".", ",", "!", "?", ""]))
    return lines


def _build_tokenizer(path: pathlib.Path, shape: Shape) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=shape.max_pos,
    )
    fast.save_pretrained(str(path))


def _build_model(path: pathlib.Path, shape: Shape) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(path))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_pos,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-5,
        dtype=shape.dtype,
    )
    torch.manual_seed(SEED)
    # transformers' stubs type the wrapped ``to`` as taking the model first.
    model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    # transformers' init is not a contract across versions: set the weights
    # explicitly so every build of the recipe gives the same model.
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
        # Special tokens get a zero output row, so their logit is exactly 0
        # while the best ordinary token's is ~3 std above: greedy never ends
        # a sequence early (no EOS), and lengths are set by max_tokens alone.
        for tid in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id):
            model.lm_head.weight[tid].zero_()
    model.generation_config.do_sample = False
    model.to(getattr(torch, shape.dtype)).save_pretrained(str(path), safe_serialization=True)


def build_tiny_llama(path: pathlib.Path, shape: Shape = TINY) -> pathlib.Path:
    """Write the tiny model of ``shape`` to ``path`` (a directory) unless already there.

    Idempotent: a complete build leaves a stamp file; a partial one (a killed
    run) is redone. Returns ``path``.
    """
    path = pathlib.Path(path)
    stamp = path / _STAMP
    recipe = {"version": RECIPE_VERSION, "shape": dataclasses.asdict(shape)}
    try:
        if json.loads(stamp.read_text()) == recipe:
            return path
    except (OSError, ValueError):
        pass
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(path, shape)
    _build_model(path, shape)
    stamp.write_text(json.dumps(recipe))
    return path


def greedy_tokens(path: pathlib.Path, prompt: str, n: int = 24) -> list[int]:
    """Greedy continuation with plain transformers (no vLLM), token ids."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(path))
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def check_varied_greedy(
    path: pathlib.Path,
    prompts: tuple[str, ...] = ("the cache block", "alpha beta gamma delta", "one two"),
    n: int = 24,
    min_distinct: int = 8,
) -> list[list[int]]:
    """Check the model does not collapse to one token under greedy decoding.

    Every prompt's continuation must have at least ``min_distinct`` distinct
    tokens, and the prompts must not all continue the same way; a
    RuntimeError says which does not (a test would otherwise prove nothing).
    """
    outs = [greedy_tokens(path, p, n) for p in prompts]
    for p, o in zip(prompts, outs):
        if EOS_ID in o:
            raise RuntimeError(f"tiny model: greedy output of {p!r} has EOS: {o}")
        if len(set(o)) < min_distinct:
            raise RuntimeError(f"tiny model: greedy output of {p!r} too repetitive: {o}")
    if len({tuple(o) for o in outs}) != len(outs):
        raise RuntimeError(f"tiny model: prompts continue alike: {outs}")
    return outs


if __name__ == "__main__":
    import sys
    import time

    t = time.monotonic()
    where = build_tiny_llama(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvelastic-tiny-llama"))
    print(f"built {where} in {time.monotonic() - t:.1f}s")
    for o in check_varied_greedy(where):
        print(o)


def offline_llm(model: str | pathlib.Path, max_model_len: int = 1024, enforce_eager: bool = True, **engine_args):
    """vLLM's offline ``LLM`` over the tiny model, as the vLLM tests' scripts
    and ``bench warm`` start it: offline, eager (unless told: the GPU kit
    captures CUDA graphs), prefix caching on, blocks of 32 tokens; ``engine_args``
    add to or replace vLLM's (the GPU bundle's attention backend, say)."""
    from kvelastic_tools.vllm_bench.vllm_serve import VLLM_ENV

    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    args = dict(dtype="float32", max_model_len=max_model_len, enforce_eager=enforce_eager,
                enable_prefix_caching=True, block_size=32, max_num_seqs=8, seed=0, disable_log_stats=False,
                kv_cache_memory_bytes=64 << 20)
    return LLM(model=str(model), **{**args, **engine_args})
