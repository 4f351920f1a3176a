"""``kvelastic bench fuzz``: a million hostile frames against a real daemon.

A daemon subprocess (host backend) serves one legitimate engine, an
``EngineClient`` and a ``WorkerClient`` in this process holding a few slabs
with data in them. Then ``kvelastic.fuzz`` frames of every kind go to the
control socket from several DEALERs (``fuzzdrive.Flood``), and a few thousand
page-channel connections misbehave. Reported: frames by kind, the daemon's
answers by reason, crashes and hangs (both must be 0), its memory and
descriptors before and after, and frames per second against the baseline:
as many valid ``Status`` requests, in the same run. Afterwards the legitimate
engine's status must be unchanged, its pages intact, and it must still grow,
write and read a new slab, and return it.
"""

from __future__ import annotations

import ctypes
import os
import socket
import tempfile
import time
import urllib.request
from typing import Any

import msgspec

from kvelastic import protocol as p
from kvelastic.bench import fuzzdrive as fd
from kvelastic.bench.daemon import daemon_process, fd_count, rss_bytes
from kvelastic.fuzz import Fuzzer, daemon_hints
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE as PAGE

LEGIT_ID = "fuzz-legitimate-engine"        # longer than any generated name: never fuzzed by accident
LEGIT_NAMESPACE = "fuzz-legitimate-namespace"
HELD_SLABS = 3
MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rejected(port: int) -> float:
    """Sum of ``kvelastic_rejected_messages_total`` over every reason."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvelastic_rejected_messages_total{"))


def _engine_status(conn: Any) -> dict:
    [mine] = [e for e in conn.call(p.Status()).status.engines if e.engine_id == LEGIT_ID]
    return msgspec.to_builtins(mine)


def _pages(worker: Any, slabs: list[int], value: int | None) -> list[int]:
    """Write ``value`` (unless None) to the first and last byte of every page of
    ``slabs`` in the worker's arena, then read them back."""
    out = []
    with worker._mu:
        offsets = [o for s in slabs for o in worker.slabs.get(s, [])]
    for offset in offsets:
        for at in (offset, offset + PAGE - 1):
            cell = ctypes.c_uint8.from_address(worker.arena.base + at)
            if value is not None:
                cell.value = value
            out.append(cell.value)
    return out


def _legit_after(engine: Any, worker: Any) -> dict[str, bool]:
    """Grow by a slab, write and read it, return it: the engine still works."""
    reply = engine.conn.call(p.Grow(engine_id=LEGIT_ID, slabs=1, demand=True), 10.0)
    grew = isinstance(reply, p.Granted) and len(reply.slabs) == 1
    served = grew and _pages(worker, reply.slabs, 0x5A) == [0x5A, 0x5A]
    back = engine.conn.call(p.Return(engine_id=LEGIT_ID, slabs=list(reply.slabs)), 10.0) if grew else None
    return {"grew": grew, "served": served, "returned": isinstance(back, p.Ok)}


def _wait_fds(pid: int, target: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := fd_count(pid)) > target and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def _tracebacks(log_path: str) -> tuple[int, str]:
    with open(log_path, errors="replace") as f:
        text = f.read()
    first = text.find("Traceback")
    return text.count("Traceback"), text[max(0, first - 300):first + 2000] if first >= 0 else ""


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    from kvelastic.client.engine import EngineClient
    from kvelastic.client.worker import WorkerClient
    from kvelastic.core.pool import SlabPool
    from kvelastic.vmm import get_backend

    count = 20_000 if quick else 1_000_000
    connections = 500 if quick else 3_000
    every = 2_000 if quick else 50_000
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "daemon.log")
        with open(log_path, "wb") as log, daemon_process(tmp, "256MiB", "host", log_level="error", log=log,
                                                         metrics_port=port) as proc:
            sock = os.path.join(tmp, "kvelastic.sock")
            alive = lambda: proc.poll() is None    # noqa: E731
            engine = EngineClient(SlabPool(8), socket_path=sock, engine_id=LEGIT_ID, namespace=LEGIT_NAMESPACE,
                                  page_size=PAGE, pages_per_worker=1, num_workers=1, block_bytes=PAGE // 8,
                                  low_watermark=0, keep_idle_slabs=HELD_SLABS, shrink_grace=3600,
                                  min_bytes=HELD_SLABS * PAGE).start()   # fuzz engines' grows never reclaim it
            worker = WorkerClient(get_backend("host"), socket_path=sock, engine_id=LEGIT_ID, rank=0,
                                  token=engine.token).start()
            try:
                if not engine.ensure(8 * HELD_SLABS, timeout=10):
                    raise RuntimeError("the legitimate engine could not grow")
                held = sorted(engine.pool.slab_ids())
                written = _pages(worker, held, 0xA7)
                time.sleep(0.5)                   # its journal and heartbeats settle
                status_before = _engine_status(engine.conn)
                rss0, fds0, rejected0 = rss_bytes(proc.pid), fd_count(proc.pid), _rejected(port)

                avoid, hints = (LEGIT_ID, LEGIT_NAMESPACE), daemon_hints(PAGE, os.getpid())
                fuzzer, channel_fuzzer = Fuzzer(seed, avoid, hints=hints), Fuzzer(seed + 1, avoid)
                join = fd.in_background(fd.channel_fuzz, sock, channel_fuzzer, connections)   # at the same time
                flood = fd.Flood(sock, alive=alive, pid=proc.pid).run(fd.frames(fuzzer), count, every)
                channels = join()
                stalled_closed = fd.stalled_hellos(sock, channel_fuzzer) if alive() else 0
                fd.beyond_maxmsgsize(sock)
                crashed = not alive() or flood.crashed_after is not None
                if not crashed:
                    fds1 = _wait_fds(proc.pid, fds0)
                    rss1, rejected1 = rss_bytes(proc.pid), _rejected(port)
                    status_after = _engine_status(engine.conn)
                    intact = _pages(worker, held, None) == written
                    legit: dict[str, Any] = {"status_unchanged": status_after == status_before, "pages_intact": intact,
                             "reconnects": engine.conn.reconnects + worker.conn.reconnects,
                             **_legit_after(engine, worker)}
                    if not legit["status_unchanged"]:
                        legit["status_diff"] = {k: (v, status_after[k]) for k, v in status_before.items()
                                                if status_after[k] != v}
                    baseline = fd.Flood(sock, alive=alive, pid=proc.pid).run(fd.status_frames(), count, every)
                crashed = crashed or not alive()
            finally:
                engine.close()      # unregisters first: its worker's channel closing is then no failure
                worker.close()
        tracebacks, first_traceback = _tracebacks(log_path)

    out: dict[str, Any] = {
        "benchmark": "fuzz", "seed": seed, "frames": flood.frames,
        "frames_by_kind": dict(sorted(flood.by_kind.items())),
        "replies_by_type": dict(sorted(flood.replies.items())), "errors_by_reason": dict(sorted(flood.errors.items())),
        "page_channel_connections": connections + 16, "page_channel_by_kind": channels,
        "stalled_hellos_closed_by_daemon": f"{stalled_closed}/16",
        "crashes": int(crashed), "crashed_after_frames": flood.crashed_after,
        "hangs": len(flood.hangs), "hang_examples": flood.hangs[:3],
        "probe_max_s": round(max(flood.probes, default=0.0), 3),
        "internal_errors": flood.errors.get(p.Reason.INTERNAL.value, 0), "daemon_log_tracebacks": tracebacks,
        "fuzz_seconds": round(flood.seconds, 1), "frames_per_second": round(flood.per_second),
        "daemon_cpu_us_per_frame": round(flood.daemon_cpu / max(1, flood.frames) * 1e6, 1),
        "page_channel_fuzz": "during the control-socket fuzz"}
    if first_traceback:
        out["first_traceback"] = first_traceback
    if flood.suspects:   # replay: Fuzzer(seed, avoid, hints).frame() n + 1 times
        out["last_frames_before_the_failure"] = flood.suspects[-8:]
    if not crashed:
        out.update({
            "rejected_metric_delta": int(rejected1 - rejected0),
            "rss_before_mib": round(rss0 / MiB, 1), "rss_after_mib": round(rss1 / MiB, 1),
            "rss_growth_mib": round((rss1 - rss0) / MiB, 1),
            "rss_at_checkpoints_mib": [round(x / MiB, 1) for x in flood.rss],
            # a leak grows between checkpoints too; warm-up (buffers, first-time paths) only before the first
            "rss_growth_after_first_checkpoint_mib": round((rss1 - flood.rss[0]) / MiB, 1) if flood.rss else None,
            "fds_before": fds0, "fds_after": fds1, "fd_growth": fds1 - fds0,
            "legitimate_engine": legit,
            "baseline_status": {"frames": baseline.frames, "seconds": round(baseline.seconds, 1),
                                "frames_per_second": round(baseline.per_second), "hangs": len(baseline.hangs),
                                "daemon_cpu_us_per_frame": round(baseline.daemon_cpu / baseline.frames * 1e6, 1)},
            "ratio_fuzz_vs_status_fps": round(flood.per_second / baseline.per_second, 3),
            "ratio_fuzz_vs_status_daemon_cpu": round(flood.daemon_cpu / flood.frames
                                                     / (baseline.daemon_cpu / baseline.frames), 3)})
    return out
