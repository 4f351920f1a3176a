"""Day-long request traces for the node simulator (``kvelastic_tools.sim.node``).

A *node* is eight serving engines on one 80 GiB device. Each engine serves
one model (its KV geometry fixes the slab: ``pages_per_worker`` pages of
2 MiB in each of its workers, a whole number of blocks of 16 tokens) and a
stream of requests whose arrival rate follows a diurnal curve with its own
phase, with bursts on top; one engine serves office hours only and is idle
for the rest of the day. Requests share per-engine system prompts (prefix
groups, Zipf-popular), so prefix caching matters; prompt and output lengths
are drawn from seeded log-normal distributions.

Time: the diurnal curve is compressed (a day of 24 hours in ``day_seconds``
of simulated time); everything below the curve is not: requests prefill and
decode at real speeds and the daemon's and clients' timings (grace periods,
deadlines, heartbeats) are the real ones.

``demand`` computes the *oracle*: the memory the trace's live requests
would hold at each second if memory were unlimited and nothing waited
(a shared prefix counted once per engine while any of its requests runs).
"""

from __future__ import annotations

import dataclasses
import math
import random

from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE

BLOCK_TOKENS = 16
KIB = 1 << 10
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Model:
    """KV geometry of one engine: bytes per token in each worker (all layers, bf16)."""

    name: str
    workers: int
    kv_per_token: int            # bytes per token per worker
    pages_per_worker: int

    @property
    def block_bytes(self) -> int:          # one block in one worker
        return self.kv_per_token * BLOCK_TOKENS

    @property
    def blocks_per_slab(self) -> int:
        n, rem = divmod(self.pages_per_worker * PAGE, self.block_bytes)
        if n < 1 or rem:
            raise ValueError(f"{self.name}: {self.pages_per_worker} pages do not hold whole blocks")
        return n

    @property
    def slab_bytes(self) -> int:
        return self.pages_per_worker * self.workers * PAGE

    @property
    def bytes_per_block(self) -> int:      # one block across every worker
        return self.block_bytes * self.workers


# Per-token KV bytes (every layer, K and V, bf16) of common models; a slab of
# a few pages per worker holds a whole number of 16-token blocks (8-28 MiB).
LLAMA_8B = Model("llama-8b", 1, 128 * KIB, 8)          # 32 layers x 8 KV heads x 128: 2 MiB blocks, 8/slab, 16 MiB
QWEN_7B = Model("qwen-7b", 1, 56 * KIB, 7)             # 28 x 4 x 128: 896 KiB blocks, 16/slab, 14 MiB
LLAMA_3B = Model("llama-3b", 1, 112 * KIB, 7)          # 28 x 8 x 128: 1.75 MiB blocks, 8/slab, 14 MiB
LLAMA_1B = Model("llama-1b", 1, 32 * KIB, 4)           # 16 x 8 x 64: 512 KiB blocks, 16/slab, 8 MiB
QWEN_14B_TP2 = Model("qwen-14b-tp2", 2, 96 * KIB, 6)   # 48 x 8 x 128 over 2 ranks: 1.5 MiB, 8/slab, 24 MiB
LLAMA_8B_TP2 = Model("llama-8b-tp2", 2, 64 * KIB, 7)   # 2 ranks: 1 MiB blocks, 14/slab, 28 MiB


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    name: str
    model: Model
    peak_gib: float              # mean live demand at the diurnal peak (before bursts)
    peak_hour: float             # hour of day of the peak
    floor: float                 # rate at the trough, as a share of the peak rate
    prompt_median: int           # tokens (log-normal)
    output_median: int           # tokens (log-normal)
    decode_tps: float            # tokens per second per request
    groups: int                  # shared system prompts (prefix groups)
    prefix_tokens: int           # length of a shared system prompt
    shared: float                # share of requests that start with one
    bursts: int = 2              # bursts in the day
    active_hours: tuple[float, float] | None = None   # serves only between these hours (else idle)
    output_cap: int = 2048       # max_tokens


NODE: tuple[EngineSpec, ...] = (
    EngineSpec("chat", LLAMA_8B, 12, 14.0, 0.15, 900, 300, 40, 8, 1024, 0.9),
    EngineSpec("code", QWEN_7B, 9, 10.5, 0.10, 3000, 250, 50, 4, 2048, 0.8),
    EngineSpec("rag", LLAMA_8B_TP2, 13, 16.0, 0.25, 6000, 200, 35, 16, 512, 0.6),
    EngineSpec("agent", LLAMA_3B, 9, 20.0, 0.20, 5000, 400, 60, 6, 3072, 0.95, bursts=4),
    EngineSpec("batch", QWEN_14B_TP2, 15, 3.0, 0.05, 2000, 600, 30, 2, 256, 0.5, bursts=1),
    EngineSpec("asia", LLAMA_8B, 10, 2.0, 0.10, 1200, 300, 40, 8, 1024, 0.85),
    EngineSpec("office", LLAMA_8B, 12, 12.0, 0.30, 1500, 300, 40, 4, 1536, 0.9, bursts=1,
               active_hours=(8.0, 19.0), output_cap=1024),
    EngineSpec("small", LLAMA_1B, 5, 18.0, 0.20, 2000, 300, 60, 12, 512, 0.7, bursts=3),
)


@dataclasses.dataclass
class Request:
    rid: int
    engine: int
    arrival: float
    prompt: int                  # tokens
    output: int                  # tokens
    group: int                   # prefix group, -1: none
    prefix_blocks: int           # full blocks of the shared prefix


@dataclasses.dataclass
class Trace:
    specs: tuple[EngineSpec, ...]
    day_seconds: float           # simulated seconds for 24 hours
    requests: list[Request]      # by arrival
    bursts: list[tuple[int, float, float, float]]   # (engine, start s, end s, factor)
    peak_rates: list[float]      # requests per second at each engine's peak
    start_hour: float = 0.0      # the hour of day at t = 0

    def hour(self, t: float) -> float:
        """Hours since midnight of the first day (past 24 on the next)."""
        return self.start_hour + 24.0 * t / self.day_seconds

    def idle_windows(self) -> dict[int, list[tuple[float, float]]]:
        """Engine -> the (start, end) seconds of the trace when it serves nothing by schedule."""
        out: dict[int, list[tuple[float, float]]] = {}
        for i, spec in enumerate(self.specs):
            if spec.active_hours is None:
                continue
            lo, hi = spec.active_hours
            spans = []
            for day in (-1, 0, 1):              # the inactive span hi..lo+24 of each calendar day
                start = (24 * day + hi - self.start_hour) * self.day_seconds / 24
                end = (24 * day + 24 + lo - self.start_hour) * self.day_seconds / 24
                start, end = max(0.0, start), min(self.day_seconds, end)
                if start < end:
                    spans.append((start, end))
            out[i] = spans
        return out


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(median * math.exp(rng.gauss(0.0, sigma)))))


def _diurnal(spec: EngineSpec, hour: float) -> float:
    """The rate at ``hour`` as a share of the peak rate."""
    h = hour % 24.0
    if spec.active_hours is not None:
        lo, hi = spec.active_hours
        if not lo <= h < hi:
            return 0.0
    x = 0.5 * (1.0 + math.cos(2 * math.pi * (h - spec.peak_hour) / 24.0))
    return spec.floor + (1.0 - spec.floor) * x ** 1.5


def _draw(rng: random.Random, spec: EngineSpec) -> tuple[int, int, int, int]:
    """(prompt tokens, output tokens, group, prefix blocks) of one request."""
    prompt = _lognormal(rng, spec.prompt_median, 0.8, 32, 32_000)
    output = _lognormal(rng, spec.output_median, 0.9, 8, spec.output_cap)
    group, prefix_blocks = -1, 0
    if rng.random() < spec.shared:
        # Zipf-ish popularity of the system prompts.
        weights = [1.0 / (k + 1) for k in range(spec.groups)]
        group = rng.choices(range(spec.groups), weights)[0]
        prompt += spec.prefix_tokens
        prefix_blocks = spec.prefix_tokens // BLOCK_TOKENS
    return prompt, output, group, prefix_blocks


def _memory_seconds(prompt: int, output: int, prefix_blocks: int, tps: float, bytes_per_block: int) -> float:
    """Byte-seconds one request's own blocks hold (its shared prefix excluded)."""
    duration = output / tps
    start = math.ceil(prompt / BLOCK_TOKENS) - prefix_blocks
    end = math.ceil((prompt + output) / BLOCK_TOKENS) - prefix_blocks
    return (start + end) / 2 * duration * bytes_per_block


def generate(seed: int, day_seconds: float, specs: tuple[EngineSpec, ...] = NODE,
             load: float = 1.0, start_hour: float = 12.0) -> Trace:
    """Every request of one day from ``start_hour`` (noon: the office engine's
    idle evening and night fall in the middle of the trace, when the night
    engines peak); ``load`` scales every engine's rate."""
    rng = random.Random(seed)
    requests: list[Request] = []
    bursts: list[tuple[int, float, float, float]] = []
    peak_rates = []
    for e, spec in enumerate(specs):
        erng = random.Random(rng.getrandbits(64))
        # The peak rate that makes the mean live demand at the peak ``peak_gib``
        # (Little's law over the request mix, sampled).
        sample = [_draw(erng, spec) for _ in range(2000)]
        mean_ms = sum(_memory_seconds(pr, out, pb, spec.decode_tps, spec.model.bytes_per_block)
                      for pr, out, _g, pb in sample) / len(sample)
        peak_rate = load * spec.peak_gib * GIB / mean_ms
        peak_rates.append(peak_rate)
        mine: list[tuple[float, float, float]] = []
        for _ in range(spec.bursts):
            start = erng.uniform(0.0, day_seconds)
            length = erng.uniform(0.2, 0.8) * day_seconds / 24       # 12 to 48 minutes of the day
            mine.append((start, start + length, erng.uniform(1.5, 2.5)))
        bursts += [(e, *b) for b in mine]
        top = peak_rate * max([f for *_x, f in mine] + [1.0])
        t = 0.0
        while True:                                    # thinning of a Poisson process at rate ``top``
            t += erng.expovariate(top)
            if t >= day_seconds:
                break
            rate = peak_rate * _diurnal(spec, start_hour + 24.0 * t / day_seconds)
            if rate and any(s <= t < end for s, end, _f in mine):
                rate *= max(f for s, end, f in mine if s <= t < end)
            if erng.random() * top < rate:
                prompt, output, group, prefix_blocks = _draw(erng, spec)
                requests.append(Request(0, e, t, prompt, output, group, prefix_blocks))
    requests.sort(key=lambda r: r.arrival)
    for i, r in enumerate(requests):
        r.rid = i
    return Trace(specs, day_seconds, requests, bursts, peak_rates, start_hour)


def prefill_seconds(prompt: int) -> float:
    """Time to first token: a chunked prefill at ~16k tokens/s."""
    return 0.02 + prompt / 16_000


def demand(trace: Trace, seconds: int) -> list[list[float]]:
    """The oracle: bytes each engine's live requests would hold at each whole
    second ``0..seconds-1`` if memory were unlimited and nothing waited."""
    engines = len(trace.specs)
    own = [[0.0] * seconds for _ in range(engines)]
    groups: list[dict[int, set[int]]] = [{} for _ in range(engines)]   # second -> active groups
    for r in trace.requests:
        spec = trace.specs[r.engine]
        start = r.arrival + prefill_seconds(r.prompt)
        end = start + r.output / spec.decode_tps
        row = own[r.engine]
        per_block = spec.model.bytes_per_block
        for s in range(math.ceil(r.arrival), min(seconds, math.ceil(end))):
            tokens = r.prompt + max(0.0, (s - start)) * spec.decode_tps
            row[s] += (math.ceil((tokens + 1) / BLOCK_TOKENS) - r.prefix_blocks) * per_block
            if r.group >= 0:
                groups[r.engine].setdefault(s, set()).add(r.group)
    for e, spec in enumerate(trace.specs):
        prefix = spec.prefix_tokens // BLOCK_TOKENS * spec.model.bytes_per_block
        for s, active in groups[e].items():
            own[e][s] += prefix * len(active)
    return own
