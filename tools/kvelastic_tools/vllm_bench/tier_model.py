"""The workload and the models of ``kvelastic bench tier``, and the oracle.

The workload (``Workload``): rotating long system prompts, each visited by a
multi-turn conversation, twice over (two passes in the same cyclic order,
the worst order for an LRU cache smaller than the working set); visits go
round-robin to the engine slots, shifted by one slot on the second pass so
that a prompt comes back on another engine than the one that computed it.
A conversation's turns all go to its visit's slot. With ``interleave`` K > 0
the turns of a visit are interleaved with other visits (think time: other
users' requests run between a user's turns): turn t+1 of visit v is sent
right after the first turn of visit v + (t+1)·K (or after the last first
turn, near the end), so K other visits' first turns run between two turns
of a conversation (``requests``). K = 0: each visit's turns back to back.

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
    visits_per_life: int     # an engine exits (and a new one takes its slot) after this many visits; 0: never
    memory: int              # kvelastic's budget (the daemon's KVELASTIC_MEMORY), bytes
    max_model_len: int
    interleave: int = 0      # K: a visit's next turn is sent after the first turns of the next K visits
    seed: int = 7
    shared_system: bool = False   # every visit opens with the same system prompt (multi-round QA's users)
    context_tokens: int = 0       # a user's own context, sent with its first turn (multi-round QA)

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

    def requests(self) -> list[tuple[int, int]]:
        """``(visit, turn)`` per request, in the order they are sent: sorted by
        ``(visit + turn·K, turn)``, so that at step j the first turn of visit j
        goes first, then turn t of visit j - t·K (K = 0: back to back)."""
        k = self.interleave
        return sorted(((v, t) for v in range(self.prompts * self.passes) for t in range(self.turns)),
                      key=lambda vt: (vt[0] + vt[1] * k, vt[1]) if k else vt)

    def system_prompt(self, index: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + (0 if self.shared_system else index))
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(self.system_tokens)]

    def user_turn(self, index: int, p: int, turn: int) -> list[int]:
        """What visit ``index`` of pass ``p`` adds at ``turn``: the user's own
        context first (``context_tokens``), then its question."""
        rng = random.Random(((self.seed * 7919 + index) * 131 + p) * 17 + turn + 1)
        n = self.user_tokens + (self.context_tokens if turn == 0 else 0)
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    def working_set_tokens(self) -> int:
        """Distinct prefix tokens of the whole trace (the shared prompt counted once)."""
        conversation = self.context_tokens + self.turns * (self.user_tokens + self.answer_tokens)
        systems = self.system_tokens * (1 if self.shared_system else self.prompts)
        return systems + self.prompts * self.passes * conversation if self.shared_system else \
            self.prompts * (self.system_tokens + self.turns * (self.user_tokens + self.answer_tokens))


# Full: 20 system prompts of 512 tokens (with their conversations ~12K
# tokens, ~4x the 24 MiB = 3,072 tokens = 96 blocks of the budget). Engines
# live for the whole mode (blocks they evict reach the tier through demotion
# source B). Interleaved with K = 18: a first turn leaves 17 full blocks
# cached (512 + 32 prompt tokens and 7 answer tokens whose KV was computed:
# 551 tokens), and the visits go round-robin to 3 slots, so between a
# visit's two turns its engine computes K / 3 = 6 other first turns, 102
# blocks: more than the 96 of the whole budget, so the conversation has left
# device memory even in an engine that holds all of it (kvelastic without the
# tier), let alone stock's 32 blocks per engine.
INTERLEAVE = 18
FULL = Workload(model="bench", engines=3, prompts=20, system_tokens=512, turns=2, user_tokens=32, answer_tokens=8,
                passes=2, visits_per_life=0, memory=24 << 20, max_model_len=768, interleave=INTERLEAVE)
# The earlier runs' workloads: turns back to back, an engine replaced after
# every visit (run 2; its kept cache was the tier's only source then) or
# every 4 (run 1's first try).
BACK_TO_BACK = dataclasses.replace(FULL, interleave=0)
LIFE1 = dataclasses.replace(FULL, interleave=0, visits_per_life=1)
LIFE4 = dataclasses.replace(FULL, interleave=0, visits_per_life=4)
# Multi-round QA, in the manner of LMCache's own benchmark: 12 users share one
# system prompt (256 tokens); each brings its own context (384 tokens) with
# its first question and asks 5 rounds (32 tokens each, 8-token answers),
# the users served round robin (K = 12: between two rounds of a user, every
# other user's round), each user on one of the 3 slots. The prefix working
# set is 256 + 12 x 584 = 7,264 tokens, 2.4x the 3,072 of the budget, and a
# user's conversation grows each round. Its longest prompt is 840 tokens, within
# the 896 positions that stock's share (1,024 tokens of KV) can serve.
MULTI_ROUND_QA = Workload(model="bench", engines=3, prompts=12, system_tokens=256, turns=5, user_tokens=32,
                          answer_tokens=8, passes=1, visits_per_life=0, memory=24 << 20, max_model_len=896,
                          interleave=12, shared_system=True, context_tokens=384)
WORKLOADS = {"interleaved": FULL, "multi_round_qa": MULTI_ROUND_QA}
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
