"""``kvelastic bench vllm`` (c): the scheduler step, stock vLLM against vLLM with kvelastic.

vLLM's v1 ``Scheduler`` is built directly (no model, no device): once over a
stock ``BlockPool``, once inside ``vllm_pool.elastic`` (the plugin's
scheduler-side patches: ``ElasticBlockPool`` on an engine registered with a
real daemon with its default settings, every slab granted before timing, the
journal shipped meanwhile, as in production: the daemon keeps departed
engines' cache, so each step that dropped a key seals it first). Both get the same number
of blocks and the same seeded request stream: requests, most sharing one of
a few prefixes, arrive so that a queue stays waiting behind a full batch of
``BATCH`` running requests; each step is ``schedule()``, then a fabricated
``ModelRunnerOutput`` (one sampled token per request whose prompt is done)
through ``update_from_output()``; requests decode, finish (``max_tokens``),
and new ones take their place. Both calls are timed per step (as called: with
kvelastic that includes the step's lock, journal numbering and ``seal_step``),
after a warm-up that fills the batch; the cache fills and evicts during the
timed steps. The two sides run in processes of their own, in lockstep (a step
of one, then the same step of the other) with both scheduler threads on one
core (``measure``), several rounds, each on fresh schedulers; each round's
median and p90 per step are taken, and the figures are the medians over rounds,
with the per-round kvelastic/stock ratio of medians (its median, lowest and
highest: the spread). Both sides must schedule the same tokens step after step
(``sched_step_same_schedule``): the comparison is fair. Target: ratio <= 1.05.

Two settings. Alone (``sched_step_*``): the kvelastic engine holds every
slab it may (its cap), so vLLM's capacity checks can never need a grow.
Under pressure (``sched_step_pressure_*``, a daemon of its own): the engine
may grow to twice what it holds, another engine holds the rest of the
daemon's memory with every block in use, so the plugin hears admissions'
needs and asks the daemon, which refuses (``demand.py``), while its pool
holds as many blocks as stock's.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from typing import Any

BS = 16
BATCH = 256                 # running requests (vLLM's max_num_seqs)
QUEUE = 16                  # requests kept waiting behind the batch
MAX_BATCHED_TOKENS = 2048   # vLLM's chunked-prefill token budget of a step
SLABS = 32                  # the bench's daemon: 64 MiB of 2 MiB pages
BLOCKS_PER_SLAB = 128
NUM_BLOCKS = SLABS * BLOCKS_PER_SLAB
PRESSURE_DAEMON_MEMORY = "128MiB"   # under pressure: SLABS for each engine
WARM_UP = 40                # steps before timing: the batch fills
STEPS, QUICK_STEPS = 200, 60
HASH_SEED = "0"
SIDE_TIMEOUT = 300.0   # a side's answer to one command (a round's start grants slabs and warms up)


def workload(n: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    """``n`` requests (id, prompt, max_tokens): three in four start with one of
    16 shared prefixes (2 to 16 blocks), then 8 to 160 tokens of their own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(30000) for _ in range(rng.randint(2, 16) * BS)] for _ in range(16)]
    out = []
    for i in range(n):
        prefix = rng.choice(prefixes) if rng.random() < 0.75 else []
        prompt = prefix + [rng.randrange(30000) for _ in range(rng.randint(8, 160))]
        out.append((f"r{i}", prompt, rng.randint(16, 160)))
    return out


def vllm_config(model: pathlib.Path, num_blocks: int = NUM_BLOCKS):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=1024,
                                 skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                         max_model_len=1024, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True))
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def scheduler(config):
    """vLLM's Scheduler over the config's blocks (ElasticBlockPool inside ``elastic``)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvelastic_tools.vllm_bench.vllm_pool import kv_config

    init_none_hash(sha256)
    return Scheduler(vllm_config=config, kv_cache_config=kv_config(config.cache_config.num_gpu_blocks, BS),
                     structured_output_manager=StructuredOutputManager(config), block_size=BS, log_stats=True)


def stepper(sched, stream: list[tuple[str, list[int], int]]) -> Iterator[tuple[float, float, int, tuple]]:
    """Steps of ``sched`` over ``stream``, one per ``next``: seconds in
    ``schedule()`` and in ``update_from_output()``, the requests scheduled,
    and what was scheduled (tokens, requests, a digest of tokens per request)."""
    from vllm.v1.outputs import ModelRunnerOutput

    from kvelastic_tools.vllm_bench.vllm_pool import request

    pending = iter(stream)
    clock = time.perf_counter
    for i in itertools.count():
        while sched.get_num_unfinished_requests() < BATCH + QUEUE:
            spec = next(pending, None)
            if spec is None:
                raise RuntimeError(f"bench vllm: the request stream ran out at step {i}")
            rid, prompt, max_tokens = spec
            sched.add_request(request(rid, prompt, BS, max_tokens))
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        req_ids = list(out.num_scheduled_tokens)
        requests = sched.requests
        sampled = [[7] if requests[rid].num_computed_tokens >= requests[rid].num_tokens else [] for rid in req_ids]
        result = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: j for j, rid in enumerate(req_ids)},
                                   sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                   pooler_output=[])
        t2 = clock()
        sched.update_from_output(out, result)
        t3 = clock()
        # The digest is the same in both sides' processes (``hash`` of a str is not).
        yield t1 - t0, t3 - t2, len(req_ids), (out.total_num_scheduled_tokens, len(req_ids),
                                               zlib.crc32(repr(sorted(out.num_scheduled_tokens.items())).encode()))


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


def measure(quick: bool, socket_path: str, model: pathlib.Path | None = None,
            rounds: int | None = None, pressure: bool = False,
            ship: bool | tuple[bool, ...] = True) -> dict[str, list[dict[str, list]]]:
    """Per side ("stock", "kvelastic"), one result per round: ``schedule`` and
    ``update`` (seconds per timed step), ``running`` (requests per timed
    step), ``plan`` (what each step scheduled, warm-up included); kvelastic's
    also ``demands`` and ``call_blocks``. ``pressure``: on a daemon of
    PRESSURE_DAEMON_MEMORY (module docstring). ``ship=False``: a control, the
    engine's journal taken and dropped, never written (no seal, no flush); a
    tuple gives each round its own (one per round: the same sides' processes
    run a control round, then a shipped one).

    Each side runs in a process of its own, and the two go in lockstep: a
    step of one, then the same step of the other (who goes first alternates),
    each waiting while the other runs, and both sides' scheduler threads on
    the same core (the daemon and the engine's I/O thread go where the kernel
    puts them). This machine's cores differ in speed, by tens of percent, from
    one second to the next (a shared host): rounds taken one after the other,
    each on whatever core it got, measured that as much as the pool
    (per-round ratios from 0.6 to 1.9; in lockstep but on either core, 0.65
    to 1.4; in lockstep on one core, 1.03 to 1.09)."""
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    if model is None:
        model = build_tiny_llama(pathlib.Path(tempfile.gettempdir()) / "kvelastic-tiny-llama")
    steps = QUICK_STEPS if quick else STEPS
    rounds = rounds or (len(ship) if isinstance(ship, tuple) else (2 if quick else 10))
    ships = ship if isinstance(ship, tuple) else (ship,) * rounds
    if len(ships) != rounds:
        raise ValueError(f"bench vllm: {len(ships)} ship settings for {rounds} rounds")
    runs: dict[str, list[dict[str, list]]] = {"stock": [], "kvelastic": []}
    with contextlib.ExitStack() as stack:
        if pressure:   # before both sides, and there until both are done
            stack.enter_context(_other_engine(socket_path))
        sides = {name: stack.enter_context(_Side(name, socket_path, model, quick, pressure)) for name in runs}
        for round_ in range(rounds):
            for side in sides.values():
                side.ask("round", round_, ships[round_])   # a fresh scheduler, warmed up
            results: dict[str, dict[str, list]] = {name: {"schedule": [], "update": [], "running": []}
                                                   for name in sides}
            for i in range(steps):
                order = ("stock", "kvelastic") if (i + round_) % 2 == 0 else ("kvelastic", "stock")
                for name in order:
                    sched_s, update_s, running = sides[name].ask("step")
                    results[name]["schedule"].append(sched_s)
                    results[name]["update"].append(update_s)
                    results[name]["running"].append(running)
            for name, side in sides.items():
                results[name].update(side.ask("end"))
                runs[name].append(results[name])
    return runs


class _Side:
    """One side of the comparison in a process of its own (``serve_side``),
    driven step by step over a socket pair."""

    def __init__(self, side: str, socket_path: str, model: pathlib.Path, quick: bool, pressure: bool) -> None:
        import multiprocessing.connection
        import socket

        ours, theirs = socket.socketpair()
        args = (side, theirs.fileno(), socket_path, str(model), quick, pressure)
        self.side = side
        # One hash seed for both sides: vLLM keys its dicts by request id (a
        # str), and a seed of its own would give each side its own collisions.
        # quick_exit first (before vLLM's handlers); the side ends without the interpreter's teardown.
        code = (f"from kvelastic_tools.vllm_bench import quick_exit; from {__name__} import serve_side; "
                f"serve_side{args!r}; quick_exit.finish()")
        self.proc = subprocess.Popen([sys.executable, "-c", code],
                                     pass_fds=[theirs.fileno()], env=dict(os.environ, PYTHONHASHSEED=HASH_SEED))
        theirs.close()
        self.conn = multiprocessing.connection.Connection(ours.detach())

    def __enter__(self) -> _Side:
        return self

    def ask(self, *command: Any) -> Any:
        try:
            self.conn.send(command)
            if not self.conn.poll(SIDE_TIMEOUT):
                raise RuntimeError(f"bench vllm: the {self.side} side did not answer {command[0]!r} "
                                   f"in {SIDE_TIMEOUT:g} s")
            status, value = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"bench vllm: the {self.side} side exited (code {self.proc.poll()})") from None
        if status != "ok":
            raise RuntimeError(f"bench vllm: the {self.side} side failed:\n{value}")
        return value

    def __exit__(self, *_exc: Any) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("exit",))
        self.conn.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve_side(side: str, fd: int, socket_path: str, model: str, quick: bool, pressure: bool) -> None:
    """A side's process (``_Side``): ``("round", n, ship)`` builds a fresh scheduler
    and runs the warm-up, ``("step",)`` runs and times one step, ``("end",)``
    ends the round (its plan, and kvelastic's demand figures), ``("exit",)``."""
    import multiprocessing.connection
    import traceback

    conn = multiprocessing.connection.Connection(fd)
    everywhere = os.sched_getaffinity(0)
    core = max(everywhere)
    stream = workload(BATCH + QUEUE + 8 * (WARM_UP + (QUICK_STEPS if quick else STEPS)))   # ~3 finish per step
    make = _stock if side == "stock" else _elastic
    while True:
        try:
            command = conn.recv()
        except EOFError:   # the bench is gone
            return
        if command[0] == "exit":
            return
        try:
            with make(socket_path, pathlib.Path(model), command[1], pressure, command[2]) as sched:
                # This thread only (its engine's I/O thread is already running,
                # free to go anywhere): both sides' steps on one core. Undone
                # below, before the next round starts its engine's threads.
                os.sched_setaffinity(0, {core})
                steps = stepper(sched, stream)
                plan = [next(steps)[3] for _ in range(WARM_UP)]
                gc.collect()
                conn.send(("ok", None))
                while conn.recv()[0] == "step":
                    sched_s, update_s, running, planned = next(steps)
                    plan.append(planned)
                    conn.send(("ok", (sched_s, update_s, running)))
                end = {"plan": plan}
                pool = sched.kv_cache_manager.block_pool
                if side == "kvelastic":
                    end.update(demands=[pool.heard, pool.demands, pool.refused_demands], call_blocks=pool.call_blocks)
            conn.send(("ok", end))
        except Exception:  # noqa: BLE001 - any failure goes to the bench, which raises it with this traceback
            conn.send(("error", traceback.format_exc()))
            return
        finally:
            os.sched_setaffinity(0, everywhere)


@contextlib.contextmanager
def _stock(_socket_path: str, model: pathlib.Path, _round: int, _pressure: bool, _ship: bool) -> Iterator[Any]:
    yield scheduler(vllm_config(model))


@contextlib.contextmanager
def _elastic(socket_path: str, model: pathlib.Path, round_: int, pressure: bool, ship: bool) -> Iterator[Any]:
    """A scheduler over ``ElasticBlockPool`` on an engine registered with the
    daemon, holding NUM_BLOCKS blocks as stock does (under pressure it may grow
    to twice that)."""
    from kvelastic_tools.vllm_bench.vllm_pool import PAGE, elastic
    from kvelastic_vllm.engine import reserve_watermark

    cap_slabs = 2 * SLABS if pressure else SLABS
    low = reserve_watermark(MAX_BATCHED_TOKENS, BS, BLOCKS_PER_SLAB)
    # A namespace per round: a slab reclaimed from a previous round's engine
    # not yet gone would bring its cache along (hits stock never has).
    with elastic(socket_path, blocks_per_slab=BLOCKS_PER_SLAB, engine_id=f"bench-sched-{round_}",
                 namespace=f"bench-sched-{round_}",
                 low_watermark=low, max_bytes=cap_slabs * PAGE, key_group_suffix=True) as link:
        if not ship:   # the control: what shipping the journal costs (docs/benchmarks.md)
            client = link.client
            client.shipper.flush = lambda *_args, **_kw: client.pool.take_journal()
        sched = scheduler(vllm_config(model, cap_slabs * BLOCKS_PER_SLAB))
        # Every slab granted before timing, or the steps would time the daemon's grants.
        if not link.client.ensure(NUM_BLOCKS - 1, timeout=30):
            raise RuntimeError(f"bench vllm: the daemon did not grant {NUM_BLOCKS} blocks in 30 s")
        core = sched.kv_cache_manager.block_pool.core
        if pressure and not link.client.can_grow():
            raise RuntimeError("bench vllm: under pressure the engine must be below its cap")
        if core.num_blocks != NUM_BLOCKS:
            raise RuntimeError(f"bench vllm: the elastic pool holds {core.num_blocks} blocks, the stock one "
                               f"{NUM_BLOCKS}: their schedules would differ")
        if core.num_cached:   # an earlier round's cache, handed on: it would hit where stock misses
            raise RuntimeError(f"bench vllm: the elastic pool adopted {core.num_cached} cached blocks "
                               "of an earlier round")
        yield sched


@contextlib.contextmanager
def _other_engine(socket_path: str) -> Iterator[None]:
    """Another engine, in a process of its own as in production (in this one
    its I/O thread would take the scheduler's GIL), holding SLABS slabs of the
    daemon with every block in use."""
    proc = subprocess.Popen([sys.executable, "-c", f"from {__name__} import hold; hold({socket_path!r})"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "held":
            raise RuntimeError(f"bench vllm: the other engine did not take its {SLABS} slabs ({line.strip()!r})")
        yield
    finally:
        if proc.stdin is not None:
            proc.stdin.close()   # it unregisters and exits
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def hold(socket_path: str) -> None:
    """The other engine: register, take SLABS slabs and use every block, say
    so, hold them until stdin closes."""
    from kvelastic.client.engine import EngineClient
    from kvelastic.core.pool import SlabPool
    from kvelastic_tools.vllm_bench.vllm_pool import PAGE

    client = EngineClient(SlabPool(BLOCKS_PER_SLAB), socket_path=socket_path, engine_id="bench-sched-other",
                          namespace="other", page_size=PAGE, pages_per_worker=1, num_workers=0,
                          block_bytes=PAGE // BLOCKS_PER_SLAB, min_bytes=SLABS * PAGE,
                          max_bytes=SLABS * PAGE).start()
    try:
        held = client.ensure(NUM_BLOCKS, timeout=30)
        if held:   # in use: an idle engine's empty slabs would go back to the daemon
            with client.lock:
                client.pool.allocate(client.pool.num_free)
        print("held" if held else "refused", flush=True)
        sys.stdin.read()
    finally:
        client.close()


def summarize(runs: dict[str, list[dict[str, list]]]) -> dict[str, Any]:
    plans = [r["plan"] for side in runs.values() for r in side]
    first = runs["stock"][0]
    warm_up = len(first["plan"]) - len(first["schedule"])
    differ = [i for plan in plans for i, (a, b) in enumerate(zip(plan, plans[0])) if a != b]
    tokens = [plan[0] for plan in first["plan"][warm_up:]]
    out: dict[str, Any] = {"sched_step_batch": int(statistics.median(first["running"])),
                           "sched_step_steps": len(first["schedule"]), "sched_step_rounds": len(runs["stock"]),
                           "sched_step_tokens_per_step": round(statistics.mean(tokens), 1),
                           "sched_step_same_schedule": not differ}
    demands = [r["demands"] for r in runs["kvelastic"]]
    # capacity checks heard, grows they asked for, grows refused
    out["sched_step_demands"] = [sum(d[i] for d in demands) for i in range(3)]
    if differ:   # not a fair comparison: where the schedules part
        out["sched_step_first_difference"] = min(differ)
    for call, key in (("schedule", "sched_step"), ("update", "sched_update")):
        med = {side: [statistics.median(r[call]) for r in rs] for side, rs in runs.items()}
        p90 = {side: [_p90(r[call]) for r in rs] for side, rs in runs.items()}
        for side in runs:
            out[f"{key}_{side}_us"] = round(statistics.median(med[side]) * 1e6, 1)
            out[f"{key}_{side}_p90_us"] = round(statistics.median(p90[side]) * 1e6, 1)
        ratios = [m / s for s, m in zip(med["stock"], med["kvelastic"])]
        out[f"{key}_ratio"] = round(statistics.median(ratios), 3)
        out[f"{key}_ratio_per_round"] = [round(min(ratios), 3), round(max(ratios), 3)]
        p90_ratios = [m / s for s, m in zip(p90["stock"], p90["kvelastic"])]
        out[f"{key}_p90_ratio"] = round(statistics.median(p90_ratios), 3)
    return out


def scheduler_step(quick: bool, model: pathlib.Path | None = None, rounds: int | None = None) -> dict[str, Any]:
    """The scheduler-step figures (``sched_step_*``, ``sched_update_*``,
    ``sched_step_pressure_*`` and ``sched_step_unshipped_*``); see the module
    docstring. Each setting on a daemon of its own with the daemon's default
    settings: it keeps departed engines' cache, so each step that dropped a
    key pays its seal, as in production (a namespace per round keeps rounds
    from adopting each other's). The control (``unshipped``, alone, fewer
    rounds) takes the journal and drops it: the difference is what writing
    it to the daemon costs the scheduler."""
    from kvelastic_tools.bench.daemon import running_daemon

    with tempfile.TemporaryDirectory() as folder, running_daemon(folder, "64MiB", orphan_ttl=None) as alone:
        out = summarize(measure(quick, alone, model, rounds))
        control = summarize(measure(quick, alone, model, CONTROL_ROUNDS, ship=False))
    with tempfile.TemporaryDirectory() as folder, \
            running_daemon(folder, PRESSURE_DAEMON_MEMORY, orphan_ttl=None) as pressed:
        under = summarize(measure(quick, pressed, model, rounds, pressure=True))
    for setting, figures in (("pressure", under), ("unshipped", control)):
        out.update({f"sched_step_{setting}_{key[len('sched_step_'):]}": value for key, value in figures.items()
                    if key.startswith("sched_step_") and key[len("sched_step_"):] in SETTING_FIELDS})
    return out


# The figures kept of the other settings (as ``sched_step_<setting>_<field>``).
SETTING_FIELDS = ("same_schedule", "demands", "stock_us", "kvelastic_us", "ratio", "ratio_per_round",
                  "p90_ratio")
CONTROL_ROUNDS = 4
