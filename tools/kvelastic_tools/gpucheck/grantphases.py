"""Where a grant's time goes (2.2 ms at p50 on an H200 against
33 us of driver calls per page). A grant makes these calls, in this order,
across two processes; here each is timed alone, per slab, on the backend's
own pages, so the sum can be set beside the grant end to end through a real
daemon (``grant`` in the same report): what the sum leaves is the protocol,
the daemon's loop and the acknowledgement.

- ``create``: the daemon's new pages (kept off the hot path by the free
  pool, but a cold grant pays it);
- ``export``: a POSIX descriptor per page (``cuMemExportToShareableHandle``
  on CUDA, a ``dup`` of the memfd on the host);
- ``transfer``: the descriptors over an AF_UNIX socket (``SCM_RIGHTS``), as
  the daemon sends them to a worker's page channel;
- ``import``: the worker's handle from each descriptor
  (``cuMemImportFromShareableHandle``);
- ``map``: into the worker's arena, access rights set (``cuMemMap`` and
  ``cuMemSetAccess``; ``mmap`` on the host);
- ``teardown``: unmapped and released again (the return's cost, not the grant's).

Each figure is per slab of ``pages`` pages, p50 and p99 over ``rounds``
rounds after one of warm-up.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from kvelastic.vmm.base import Backend
from kvelastic_tools.figures import percentile

PHASES = ("create", "export", "transfer", "import", "map", "teardown")
GRANT_PHASES = PHASES[:-1]


def grant_phases(backend: Backend, pages: int = 1, rounds: int = 50) -> dict[str, Any]:
    """Each phase of a grant of ``pages`` pages, timed alone (module docstring)."""
    ps = backend.page_size
    samples: dict[str, list[int]] = {k: [] for k in PHASES}
    arena = backend.reserve(pages * ps)
    daemon_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for r in range(rounds + 1):
            t = [time.perf_counter_ns()]
            created = backend.create_pages(pages)
            t.append(time.perf_counter_ns())
            fds = [backend.export(page) for page in created]
            t.append(time.perf_counter_ns())
            socket.send_fds(daemon_end, [b"p"], fds)
            _, received, _, _ = socket.recv_fds(worker_end, 1, len(fds))
            t.append(time.perf_counter_ns())
            for fd in fds:                    # the daemon's copies, once sent
                os.close(fd)
            imported = [backend.import_page(fd) for fd in received]
            t.append(time.perf_counter_ns())
            for i, page in enumerate(imported):
                arena.map(i * ps, page)
            t.append(time.perf_counter_ns())
            for i in range(len(imported)):
                backend.release_page(arena.unmap(i * ps))
            for page in created:
                backend.release_page(page)
            t.append(time.perf_counter_ns())
            if r:                             # round 0 is warm-up
                for name, start, end in zip(PHASES, t, t[1:]):
                    samples[name].append(end - start)
    finally:
        arena.close()
        daemon_end.close()
        worker_end.close()
    per_phase = {name: {"p50_us": round(percentile(s, 0.5) / 1e3, 1), "p99_us": round(percentile(s, 0.99) / 1e3, 1)}
                 for name, s in samples.items()}
    return {"pages_per_slab": pages, "rounds": rounds, "per_slab": per_phase,
            "grant_calls_p50_us": round(sum(per_phase[name]["p50_us"] for name in GRANT_PHASES), 1)}


def unaccounted(phases: dict[str, Any], grant: dict[str, Any]) -> dict[str, Any]:
    """The grant end to end (one engine, one page a slab) against the sum of
    its calls: what the protocol, the loop and the acknowledgement take."""
    end_to_end = grant.get("1_engine", {}).get("grant_p50_us")
    calls = phases.get("grant_calls_p50_us")
    if end_to_end is None or calls is None or phases.get("pages_per_slab") != grant.get("pages_per_slab"):
        return {"error": "no comparable grant figures"}
    return {"grant_p50_us": end_to_end, "calls_p50_us": calls,
            "protocol_loop_ack_us": round(end_to_end - calls, 1),
            "calls_share": round(calls / end_to_end, 3) if end_to_end else None}
