"""The workloads of ``kvelastic bench elastic`` and what it watches while they run.

- ``Shape``: one request's shape (a shared system prompt of the engine, a
  unique suffix, greedy output of a fixed length) and what it costs in KV
  blocks; ``Scenario``: how hard the load presses (the hot engine's arrival
  rate, how long a phase lasts, the idle gap after it), sized by the bench
  from what one engine serves here (``elastic_calibrate``).
- ``make_workload``: a seeded request list of a scenario: phases, each with
  one hot engine that gets most of the requests, evenly spaced (a little
  jitter) at the scenario's rate, and a trickle to the others; the hot engine
  rotates from phase to phase; idle gaps between phases. Prompts are token
  ids (exact lengths, no tokenizer).
- ``run_load``: sends it open loop (each request at its own time, whatever
  the earlier ones are doing) over async HTTP, streaming, and records time
  to first token, end-to-end time and the generated token ids;
  ``run_closed``: a closed loop of ``concurrency`` clients (calibration).
- ``StatusPoller``: the daemon's status every ~150 ms in a thread;
  ``GaugePoller``: vLLM's running / waiting gauges of each server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import re
import threading
import time
import urllib.request
from typing import Any

VOCAB = (3, 512)          # the tiny model's ordinary token ids (0-2 are <s>, </s>, <pad>)
BLOCK_TOKENS = 32         # the bench's --block-size


@dataclasses.dataclass(frozen=True)
class Shape:
    """One request: one of the engine's ``system_prompts`` (``system_len``
    tokens, shared, so cached) plus ``suffix_len`` tokens of its own, then
    ``max_tokens`` of greedy output."""
    system_prompts: int
    system_len: int
    suffix_len: int
    max_tokens: int

    @property
    def request_blocks(self) -> int:
        """KV blocks one running request holds beyond its shared system prompt."""
        return math.ceil(self.suffix_len / BLOCK_TOKENS) + math.ceil(self.max_tokens / BLOCK_TOKENS)

    @property
    def system_blocks(self) -> int:
        """KV blocks of an engine's system prompts, all of them cached."""
        return self.system_prompts * self.system_len // BLOCK_TOKENS

    def blocks_for(self, running: float) -> float:
        """Blocks an engine needs to run ``running`` requests at once."""
        return self.system_blocks + running * self.request_blocks

    def running_for(self, blocks: float) -> float:
        """How many requests ``blocks`` run at once (the inverse of ``blocks_for``)."""
        return max(0.0, (blocks - self.system_blocks) / self.request_blocks)


# Two system prompts of 256 tokens an engine (16 blocks, an eighth of a 4 MiB share) and 512
# tokens of its own: 22 blocks a running request.
FULL_SHAPE = Shape(system_prompts=2, system_len=256, suffix_len=512, max_tokens=192)
# The test's: a quarter of the decode, so a phase lasts a quarter as long.
QUICK_SHAPE = Shape(system_prompts=2, system_len=256, suffix_len=512, max_tokens=48)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """How a load presses: every phase sends its hot engine ``hot_rate``
    requests a second for ``phase_seconds``, the other engines together
    ``(1 - hot_share) / hot_share`` of that, then ``gap`` idle seconds."""
    name: str
    phases: int                 # the hot engine rotates: phase k's is engine k % N
    hot_rate: float             # requests per second to the hot engine
    phase_seconds: float
    gap: float
    hot_share: float = 0.85     # of a phase's requests
    jitter: float = 0.5         # of the hot inter-arrival time, uniform


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
    scenario: Scenario | None = None
    seed: int = 0


def make_workload(engines: int, shape: Shape, scenario: Scenario, seed: int = 0) -> Workload:
    """The request list of ``scenario``; the same ``seed`` gives the same
    requests (prompts, engines, times), another seed other prompts (no
    prefix in common with it)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    systems = [[tokens(shape.system_len) for _ in range(shape.system_prompts)] for _ in range(engines)]
    hot_n = max(1, round(scenario.hot_rate * scenario.phase_seconds))
    every = scenario.phase_seconds / hot_n
    cold_n = round(hot_n * (1 - scenario.hot_share) / scenario.hot_share) if engines > 1 else 0
    items: list[tuple[float, int, int, bool]] = []
    phases: list[Phase] = []
    t = 0.0
    for k in range(scenario.phases):
        hot = k % engines
        items += [(t + i * every + rng.uniform(0, scenario.jitter * every), hot, k, True) for i in range(hot_n)]
        others = [e for e in range(engines) if e != hot]
        items += [(t + rng.uniform(0, scenario.phase_seconds), rng.choice(others), k, False) for _ in range(cold_n)]
        last = max(at for at, _, phase, _ in items if phase == k)
        phases.append(Phase(t, last, hot))
        t = last + scenario.gap
    items.sort()
    requests = [Request(i, engine, k, hot, round(at, 4), rng.choice(systems[engine]) + tokens(shape.suffix_len),
                        shape.max_tokens) for i, (at, engine, k, hot) in enumerate(items)]
    return Workload(shape, engines, requests, phases, scenario, seed)


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
    warm = Workload(FULL_SHAPE, len(bases), [Request(i, i, 0, False, 0.0,
                                                     [rng.randrange(*VOCAB) for _ in range(64)], 8)
                                             for i in range(len(bases))], [])
    bad = [r.error for r in run_load(bases, warm, time.monotonic(), timeout=120) if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad}")


def run_closed(base: str, shape: Shape, concurrency: int, rounds: int, seed: int, stagger: float,
               timeout: float = 300.0, trickle: list[str] | None = None, trickle_rate: float = 0.0) -> list[Result]:
    """A closed loop: ``concurrency`` clients, client ``i`` starting ``i *
    stagger`` seconds in, each sending ``rounds`` requests of ``shape`` one
    after the other (fresh suffixes, the system prompts of ``seed``) to
    ``base``. Results in completion order; ``sent`` is seconds after the start.
    ``trickle``: other servers, each sent requests of ``shape`` open loop at
    ``trickle_rate`` a second while the clients run (the cold engines of a
    scenario, whose steps take the CPU from the measured one); their
    results are not returned, and those still running at the end are dropped."""
    import aiohttp

    rng = random.Random(seed)
    systems = [[rng.randrange(*VOCAB) for _ in range(shape.system_len)] for _ in range(shape.system_prompts)]

    def prompt() -> list[int]:
        return rng.choice(systems) + [rng.randrange(*VOCAB) for _ in range(shape.suffix_len)]

    prompts = [[prompt() for _ in range(rounds)] for _ in range(concurrency)]
    done: list[Result] = []

    async def client(session, i: int, t0: float) -> None:
        await asyncio.sleep(i * stagger)
        for k in range(rounds):
            at = time.monotonic() - t0
            req = Request(i * rounds + k, 0, 0, True, at, prompts[i][k], shape.max_tokens)
            done.append(await _one(session, base, req, t0, timeout))

    async def cold(session, other: str, t0: float, pending: set) -> None:
        k = 0
        while True:
            await asyncio.sleep(rng.uniform(0.5, 1.5) / trickle_rate)
            req = Request(-1 - k, 1, 0, False, time.monotonic() - t0, prompt(), shape.max_tokens)
            task = asyncio.ensure_future(_one(session, other, req, t0, timeout))
            pending.add(task)
            task.add_done_callback(pending.discard)
            k += 1

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            t0 = time.monotonic()
            pending: set = set()
            background = [asyncio.ensure_future(cold(session, other, t0, pending))
                          for other in (trickle or []) if trickle_rate > 0]
            try:
                await asyncio.gather(*[client(session, i, t0) for i in range(concurrency)])
            finally:
                for task in [*background, *pending]:
                    task.cancel()
                await asyncio.gather(*background, *pending, return_exceptions=True)

    asyncio.run(main())
    return done


# ------------------------------------------------------------- the daemon
def compact_status(status: dict[str, Any]) -> dict[str, Any]:
    """What the bench keeps of one status sample: per engine what it holds
    and why (live and cached blocks, idle, starved, cumulative grants, returns
    and reclaims), and the device's free and never-created memory."""
    dev = status["devices"][0] if status.get("devices") else {}
    return {"engines": {e["engine_id"]: {"held": e["held_bytes"], "live": e["live_blocks"],
                                         "cached": e["cached_blocks"], "idle": e["idle"],
                                         "starved_s": e.get("starved_seconds", 0.0), "grants": e["grants"],
                                         "returns": e["returns"], "reclaims": e["reclaims"]}
                        for e in status["engines"]},
            "free": dev.get("memory", {}).get("free", 0), "unallocated": dev.get("memory", {}).get("unallocated", 0),
            "slab_moves": dev.get("slab_moves", 0), "thrash": dev.get("thrash", 0)}


class _Poller:
    """Calls ``sample()`` every ``interval`` seconds in a thread until stopped;
    keeps (monotonic time, sample) pairs and counts the calls that failed."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.samples: list[tuple[float, Any]] = []
        self.latencies: list[float] = []     # seconds each sample took (a stalled peer shows)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)

    def sample(self) -> Any:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                got = self.sample()
                self.samples.append((start, got))
                self.latencies.append(time.monotonic() - start)
            except Exception:   # noqa: BLE001 - a missed sample is counted, never fatal
                self.errors += 1
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - start)))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def latest(self) -> Any:
        return self.samples[-1][1] if self.samples else {}


class StatusPoller(_Poller):
    """The daemon's status every ``interval`` seconds, compacted (``compact_status``)."""

    def __init__(self, socket_path: str, interval: float = 0.15) -> None:
        super().__init__(interval)
        self.socket_path = socket_path

    def sample(self) -> dict[str, Any]:
        from kvelastic.ctl import get_status

        return compact_status(get_status(self.socket_path, timeout=1.0))


_GAUGE = re.compile(r"^vllm:(num_requests_running|num_requests_waiting)(?:\{[^}]*\})? (\S+)$", re.M)


class GaugePoller(_Poller):
    """vLLM's ``num_requests_running`` and ``num_requests_waiting`` of each
    server every ``interval`` seconds: a list of (running, waiting) per server
    (None for one that did not answer). Every mode is polled alike, so the
    polling costs each the same."""

    def __init__(self, bases: list[str], interval: float = 0.25) -> None:
        super().__init__(interval)
        self.bases = bases

    def sample(self) -> list[tuple[int, int] | None]:
        out: list[tuple[int, int] | None] = []
        for base in self.bases:
            try:
                with urllib.request.urlopen(base + "/metrics", timeout=2.0) as r:
                    text = r.read().decode()
            except OSError:
                out.append(None)
                continue
            got = dict.fromkeys(("num_requests_running", "num_requests_waiting"), 0.0)
            for name, value in _GAUGE.findall(text):
                got[name] += float(value)
            out.append((int(got["num_requests_running"]), int(got["num_requests_waiting"])))
        return out


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
