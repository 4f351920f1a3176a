"""The workload of ``kvelastic bench elastic`` and what it watches while it runs.

- ``make_workload``: a seeded, bursty, skewed request list whose hot engine
  rotates: phases, each with one hot engine that gets most of the requests
  (in bursts that arrive together) and a trickle to the others, idle gaps
  between phases. Prompts are token ids (exact lengths, no tokenizer): one
  of a few system prompts of the engine plus a per-request suffix.
- ``run_load``: sends it open loop (each request at its own time, whatever
  the earlier ones are doing) over async HTTP, streaming, and records time
  to first token, end-to-end time and the generated token ids.
- ``StatusPoller``: the daemon's status every ~150 ms in a thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from typing import Any

VOCAB = (3, 512)          # the tiny model's ordinary token ids (0-2 are <s>, </s>, <pad>)


@dataclasses.dataclass(frozen=True)
class Shape:
    phases: int                 # the hot engine rotates: phase k's is engine k % N
    bursts: int                 # bursts of hot requests per phase
    burst_every: float          # seconds between bursts
    burst_size: int             # hot requests per burst (they arrive within burst_spread)
    burst_spread: float
    hot_share: float            # of all requests in a phase
    gap: float                  # idle seconds between phases
    system_prompts: int         # per engine
    system_len: int             # tokens
    suffix_len: int             # tokens (per request)
    max_tokens: int


FULL = Shape(phases=6, bursts=1, burst_every=5.0, burst_size=32, burst_spread=0.5, hot_share=0.85, gap=7.0,
             system_prompts=4, system_len=512, suffix_len=512, max_tokens=192)
QUICK = dataclasses.replace(FULL, phases=3)


@dataclasses.dataclass(frozen=True)
class Request:
    idx: int
    engine: int
    phase: int
    hot: bool
    at: float                   # seconds after the load starts
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass
class Phase:
    start: float
    end: float                  # the last arrival of the phase
    hot: int


@dataclasses.dataclass
class Workload:
    shape: Shape
    engines: int
    requests: list[Request]
    phases: list[Phase]


def make_workload(engines: int, shape: Shape, seed: int = 0) -> Workload:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    systems = [[tokens(shape.system_len) for _ in range(shape.system_prompts)] for _ in range(engines)]
    hot_n = shape.bursts * shape.burst_size
    cold_n = round(hot_n * (1 - shape.hot_share) / shape.hot_share)
    span = shape.bursts * shape.burst_every
    items: list[tuple[float, int, int, bool]] = []
    phases: list[Phase] = []
    t = 0.0
    for k in range(shape.phases):
        hot = k % engines
        for b in range(shape.bursts):
            items += [(t + b * shape.burst_every + rng.uniform(0, shape.burst_spread), hot, k, True)
                      for _ in range(shape.burst_size)]
        others = [e for e in range(engines) if e != hot]
        items += [(t + rng.uniform(0, span), rng.choice(others), k, False) for _ in range(cold_n)]
        last = max(at for at, _, phase, _ in items if phase == k)
        phases.append(Phase(t, last, hot))
        t = last + shape.gap
    items.sort()
    requests = [Request(i, engine, k, hot, round(at, 4), rng.choice(systems[engine]) + tokens(shape.suffix_len),
                        shape.max_tokens) for i, (at, engine, k, hot) in enumerate(items)]
    return Workload(shape, engines, requests, phases)


# ------------------------------------------------------------------ client
@dataclasses.dataclass
class Result:
    idx: int
    engine: int
    hot: bool
    sent: float                 # seconds after the load started
    ttft: float | None = None
    e2e: float | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft is not None


async def _one(session, base: str, req: Request, t0: float, timeout: float) -> Result:
    import aiohttp

    await asyncio.sleep(max(0.0, t0 + req.at - time.monotonic()))
    sent = time.monotonic()
    res = Result(req.idx, req.engine, req.hot, sent - t0)
    body = {"model": "tiny", "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    try:
        async with session.post(base + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"])[:200]
                    break
                for choice in event.get("choices", ()):
                    ids = choice.get("token_ids") or []
                    if ids and res.ttft is None:
                        res.ttft = time.monotonic() - sent
                    res.tokens += ids
                    res.text += choice.get("text") or ""
        res.e2e = time.monotonic() - sent
        if not res.error and len(res.tokens) != req.max_tokens:
            res.error = f"{len(res.tokens)} tokens, expected {req.max_tokens}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


def run_load(bases: list[str], workload: Workload, t0: float, timeout: float = 180.0) -> list[Result]:
    """Send every request at ``t0 + at`` (``time.monotonic()`` clock) to its
    engine's server; one result per request, in request order."""
    import aiohttp

    async def main() -> list[Result]:
        # A connection per request: no keep-alive connection closed by the server under a request.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            return list(await asyncio.gather(*[_one(session, bases[r.engine], r, t0, timeout)
                                               for r in workload.requests]))

    return asyncio.run(main())


def warm_up(bases: list[str], seed: int = 99) -> None:
    """One short request per server (prompts unlike the workload's), so that
    first-request costs fall outside the measured load."""
    rng = random.Random(seed)
    warm = Workload(FULL, len(bases), [Request(i, i, 0, False, 0.0, [rng.randrange(*VOCAB) for _ in range(64)], 8)
                                       for i in range(len(bases))], [])
    bad = [r.error for r in run_load(bases, warm, time.monotonic(), timeout=120) if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad}")


# ------------------------------------------------------------- the daemon
class StatusPoller:
    """The daemon's status every ``interval`` seconds (monotonic time, the
    report as plain data) until stopped."""

    def __init__(self, socket_path: str, interval: float = 0.15) -> None:
        self.socket_path = socket_path
        self.interval = interval
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self.latencies: list[float] = []     # seconds each status request took (a stalled daemon shows)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-status", daemon=True)

    def _run(self) -> None:
        from kvelastic.ctl import get_status

        while not self._stop.is_set():
            start = time.monotonic()
            try:
                self.samples.append((time.monotonic(), get_status(self.socket_path, timeout=1.0)))
                self.latencies.append(time.monotonic() - start)
            except Exception:   # noqa: BLE001 - a missed sample is counted, never fatal
                self.errors += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> StatusPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def latest(self) -> dict[str, Any]:
        return self.samples[-1][1] if self.samples else {}


class StallMonitor:
    """How late a 20 ms sleep of this process wakes up, at worst: a machine
    that stalls every process (or starves this one) shows here, and such a
    stall is what makes a daemon miss an engine's heartbeats."""

    def __init__(self, period: float = 0.02) -> None:
        self.period = period
        self.worst = 0.0
        self.worst_at = 0.0
        self.over_1s = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-stall", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            time.sleep(self.period)
            late = time.monotonic() - start - self.period
            if late > self.worst:
                self.worst, self.worst_at = late, start
            self.over_1s += late > 1.0

    def __enter__(self) -> StallMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
