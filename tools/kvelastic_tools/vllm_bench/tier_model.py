"""The workload and the models of ``kvelastic bench tier``, and the oracle.

The workload (``trace``): rotating long system prompts, each visited by a
multi-turn conversation, twice over (two passes in the same cyclic order,
the worst order for an LRU cache smaller than the working set); visits go
round-robin to the engine slots, shifted by one slot on the second pass so
that a prompt comes back on another engine than the one that computed it.

The oracle (``oracle_hits``): vLLM's prefix cache with infinite room, over
the prompts a mode actually sent (their answers are the engine's own):
the longest run of full blocks seen before (blocks of every earlier prompt
and of its greedy answer but the last token, whose KV is never computed),
leaving at least one prompt token to compute, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
import tempfile

from kvelastic_tools.vllm_bench.tinymodel import TINY, VOCAB_SIZE, Shape, build_tiny_llama

BLOCK = 32          # tokens per block (vLLM's CPU attention: multiples of 32)
# The benchmark's model: a random-weight Llama whose prefill costs far more
# than loading its KV (61 M parameters: hidden 1024, MLP 4096, four layers;
# 4 KV heads of 64 against 16 query heads, 8 KiB of KV per token in float32):
# ~1 ms of prefill per token on one core of the 2-core machine, against
# ~0.01 ms to load its 8 KiB.
BENCH = Shape(hidden=1024, intermediate=4096, layers=4, heads=16, kv_heads=4, head_dim=64, max_pos=4096)


def kv_bytes_per_token(shape: Shape) -> int:
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * (4 if shape.dtype == "float32" else 2)


def params(shape: Shape) -> int:
    attn = 2 * shape.hidden * shape.heads * shape.head_dim + 2 * shape.hidden * shape.kv_heads * shape.head_dim
    mlp = 3 * shape.hidden * shape.intermediate
    return shape.layers * (attn + mlp + 2 * shape.hidden) + 2 * VOCAB_SIZE * shape.hidden + shape.hidden


def build(name: str) -> tuple[pathlib.Path, Shape]:
    """``tiny`` (the tests' model) or ``bench``, built once in the temporary directory."""
    shape = TINY if name == "tiny" else BENCH
    folder = "kvelastic-tiny-llama" if name == "tiny" else "kvelastic-tier-llama"
    return build_tiny_llama(pathlib.Path(tempfile.gettempdir()) / folder, shape), shape


@dataclasses.dataclass(frozen=True)
class Workload:
    model: str               # "tiny" or "bench"
    engines: int             # engine slots served round-robin
    prompts: int             # rotating system prompts
    system_tokens: int       # tokens in each
    turns: int               # turns of each visit's conversation
    user_tokens: int         # tokens a user adds per turn
    answer_tokens: int       # greedy tokens per answer
    passes: int              # times every system prompt is visited
    visits_per_life: int     # an engine exits (and a new one takes its slot) after this many visits
    memory: int              # kvelastic's budget (the daemon's KVELASTIC_MEMORY), bytes
    max_model_len: int
    seed: int = 7

    @property
    def per_engine(self) -> int:
        """Stock vLLM's static share of ``memory`` (its ``kv_cache_memory_bytes``)."""
        return self.memory // self.engines

    def visits(self) -> list[tuple[int, int, int]]:
        """``(slot, pass, system prompt)`` per visit, in order."""
        out = []
        for p in range(self.passes):
            for i in range(self.prompts):
                out.append(((i + p) % self.engines, p, i))
        return out

    def system_prompt(self, index: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + index)
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(self.system_tokens)]

    def user_turn(self, index: int, p: int, turn: int) -> list[int]:
        rng = random.Random(((self.seed * 7919 + index) * 131 + p) * 17 + turn + 1)
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(self.user_tokens)]


# Full: 20 system prompts of 512 tokens (with their conversations ~12K
# tokens, ~4x the 24 MiB = 3,072 tokens of the budget); an engine is
# replaced after every visit, so that every block it computed leaves as kept
# cache (the tier's only source today). ``LIFE4``: replaced every 4 visits,
# its blocks evicted inside the engine meanwhile lost to the tier.
FULL = Workload(model="bench", engines=3, prompts=20, system_tokens=512, turns=2, user_tokens=32, answer_tokens=8,
                passes=2, visits_per_life=1, memory=24 << 20, max_model_len=768)
LIFE4 = dataclasses.replace(FULL, visits_per_life=4)
# Quick (the test): the tiny model, two slots, every visit on a new engine.
QUICK = Workload(model="tiny", engines=2, prompts=2, system_tokens=256, turns=2, user_tokens=32, answer_tokens=8,
                 passes=2, visits_per_life=1, memory=16 << 20, max_model_len=768)


def _blocks(tokens: list[int]) -> list[tuple[int, ...]]:
    """Chained keys of the full blocks of ``tokens`` (a block's key is its whole prefix)."""
    keys: list[tuple[int, ...]] = []
    h: tuple[int, ...] = ()
    for i in range(len(tokens) // BLOCK):
        h = (hash((h, tuple(tokens[i * BLOCK:(i + 1) * BLOCK]))),)
        keys.append(h)
    return keys


def oracle_hits(requests: list[tuple[list[int], list[int]]]) -> list[int]:
    """Hit tokens of each ``(prompt, answer)`` against a cache that never evicts."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for prompt, answer in requests:
        keys = _blocks(prompt)
        hit = 0
        for key in keys[:(len(prompt) - 1) // BLOCK]:
            if key not in seen:
                break
            hit += 1
        out.append(hit * BLOCK)
        seen.update(_blocks(prompt + answer[:-1]))
    return out
