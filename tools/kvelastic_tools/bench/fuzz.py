"""``kvelastic bench fuzz``: a million hostile frames, then hostile
sequences, against a real daemon.

Two sections, each with its own daemon subprocess (host backend) and a
legitimate engine beside the fuzz (``fuzzdrive.Legit``: an ``EngineClient``
and a ``WorkerClient`` in this process holding a few slabs with data in them):

- ``frames``: ``kvelastic_tools.fuzz`` frames of every kind go to the control
  socket from several DEALERs (``fuzzdrive.Flood``), and a few thousand
  page-channel connections misbehave. Reported: frames by kind, the daemon's
  answers by reason, its memory and descriptors before and after, and frames
  per second against the baseline: as many valid ``Status`` requests, in the
  same run.
- ``sequences``: several clients drive well-formed protocol sequences with
  reused engine ids and hostile-but-valid values (``fuzzseq``).

Each section reports ``crashes``, ``hangs`` (a ``Status`` from a separate
process every 20 ms unanswered for 2 s), ``pages_lost`` (once every fuzz
client is gone and every deadline has passed: pages that count against the
budget yet are neither free nor the legitimate engine's) and
``status_p99_ms`` (that ``Status`` under attack); the top level sums them
(the worst p99). Afterwards the legitimate engine's status must be unchanged,
its pages intact, and it must still grow, write and read a new slab, and
return it.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from kvelastic import protocol as p
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE
from kvelastic_tools.bench import fuzzdrive as fd
from kvelastic_tools.bench import fuzzseq
from kvelastic_tools.bench.daemon import daemon_process, fd_count, rss_bytes
from kvelastic_tools.fuzz import Fuzzer, daemon_hints

HELD_SLABS = 3
MiB = 1 << 20


def _wait_fds(pid: int, target: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := fd_count(pid)) > target and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Both sections, each against a daemon of its own."""
    frames = run_frames(quick, seed)
    sequences = fuzzseq.run(quick=quick, seed=seed)
    sections = (frames, sequences)
    lost = [s["pages_lost"] for s in sections]
    return {"benchmark": "fuzz", "seed": seed,
            "crashes": sum(s["crashes"] for s in sections), "hangs": sum(s["hangs"] for s in sections),
            "pages_lost": None if None in lost else sum(lost),     # None: a daemon that died or froze has no books
            "status_p99_ms": max(s["status_p99_ms"] for s in sections),
            "ok": all(s["ok"] for s in sections), "frames": frames, "sequences": sequences}


def run_frames(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """The frames section: a flood of fuzzed frames and page-channel connections."""
    count = 20_000 if quick else 1_000_000
    connections = 500 if quick else 3_000
    every = 2_000 if quick else 50_000
    port = fd.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "daemon.log")
        with open(log_path, "wb") as log, daemon_process(tmp, "256MiB", "host", log_level="error", log=log,
                                                         metrics_port=port) as proc:
            sock = os.path.join(tmp, "kvelastic.sock")
            alive = lambda: proc.poll() is None    # noqa: E731
            legit = fd.Legit(sock, slabs=HELD_SLABS, page_size=PAGE)  # guaranteed: fuzz engines never reclaim it
            try:
                rss0, fds0, rejected0 = rss_bytes(proc.pid), fd_count(proc.pid), fd.rejected_total(port)
                avoid, hints = (fd.LEGIT_ID, fd.LEGIT_NAMESPACE), daemon_hints(PAGE, os.getpid())
                fuzzer, channel_fuzzer = Fuzzer(seed, avoid, hints=hints), Fuzzer(seed + 1, avoid)
                probe = fd.StatusProbe(sock)
                join = fd.in_background(fd.channel_fuzz, sock, channel_fuzzer, connections)   # at the same time
                flood = fd.Flood(sock, alive=alive, pid=proc.pid).run(fd.frames(fuzzer), count, every)
                channels = join()
                stalled_closed = fd.stalled_hellos(sock, channel_fuzzer) if alive() else 0
                fd.beyond_maxmsgsize(sock)
                under_attack = probe.stop()
                crashed = not alive() or flood.crashed_after is not None
                if not crashed:
                    # Every fuzz engine gone (no lifeline: dropped at the heartbeat deadline), then the books.
                    end, engines = fuzzseq.settle(sock, legit.pages_held, 10.0)
                    fds1 = _wait_fds(proc.pid, fds0)
                    rss1, rejected1 = rss_bytes(proc.pid), fd.rejected_total(port)
                    legit_report = legit.check()
                    baseline = fd.Flood(sock, alive=alive, pid=proc.pid).run(fd.status_frames(), count, every)
                crashed = crashed or not alive()
            finally:
                legit.close(unregister=alive())
        tracebacks, first_traceback = fd.tracebacks(log_path)

    out: dict[str, Any] = {
        "seed": seed, "frames": flood.frames,
        "frames_by_kind": dict(sorted(flood.by_kind.items())),
        "replies_by_type": dict(sorted(flood.replies.items())), "errors_by_reason": dict(sorted(flood.errors.items())),
        "page_channel_connections": connections + 16, "page_channel_by_kind": channels,
        "stalled_hellos_closed_by_daemon": f"{stalled_closed}/16",
        "crashes": int(crashed), "crashed_after_frames": flood.crashed_after,
        "hangs": len(flood.hangs) + under_attack["hangs"], "hang_examples": flood.hangs[:3],
        "probe_max_s": round(max(flood.probes, default=0.0), 3), **under_attack,
        "internal_errors": flood.errors.get(p.Reason.INTERNAL.value, 0), "daemon_log_tracebacks": tracebacks,
        "fuzz_seconds": round(flood.seconds, 1), "frames_per_second": round(flood.per_second),
        "daemon_cpu_us_per_frame": round(flood.daemon_cpu / max(1, flood.frames) * 1e6, 1),
        "page_channel_fuzz": "during the control-socket fuzz", "pages_lost": None}
    if first_traceback:
        out["first_traceback"] = first_traceback
    if flood.suspects:   # replay: Fuzzer(seed, avoid, hints).frame() n + 1 times
        out["last_frames_before_the_failure"] = flood.suspects[-8:]
    if not crashed:
        if end is not None:
            # Counted against the budget, yet neither free nor the legitimate engine's.
            out["pages_lost"] = end["created"] + end["adopted"] - end["free"] - legit.pages_held
            out["books_after"] = {**end, "engines": engines, "legit_pages": legit.pages_held}
        out.update({
            "rejected_metric_delta": int(rejected1 - rejected0),
            "rss_before_mib": round(rss0 / MiB, 1), "rss_after_mib": round(rss1 / MiB, 1),
            "rss_growth_mib": round((rss1 - rss0) / MiB, 1),
            "rss_at_checkpoints_mib": [round(x / MiB, 1) for x in flood.rss],
            # a leak grows between checkpoints too; warm-up (buffers, first-time paths) only before the first
            "rss_growth_after_first_checkpoint_mib": round((rss1 - flood.rss[0]) / MiB, 1) if flood.rss else None,
            "fds_before": fds0, "fds_after": fds1, "fd_growth": fds1 - fds0,
            "legitimate_engine": legit_report,
            "baseline_status": {"frames": baseline.frames, "seconds": round(baseline.seconds, 1),
                                "frames_per_second": round(baseline.per_second), "hangs": len(baseline.hangs),
                                "daemon_cpu_us_per_frame": round(baseline.daemon_cpu / baseline.frames * 1e6, 1)},
            "ratio_fuzz_vs_status_fps": round(flood.per_second / baseline.per_second, 3),
            "ratio_fuzz_vs_status_daemon_cpu": round(flood.daemon_cpu / flood.frames
                                                     / (baseline.daemon_cpu / baseline.frames), 3)})
    out["ok"] = (not out["crashes"] and not out["hangs"] and out["pages_lost"] == 0 and not out["internal_errors"]
                 and not tracebacks and out.get("legitimate_engine", {}).get("ok", False))
    return out
