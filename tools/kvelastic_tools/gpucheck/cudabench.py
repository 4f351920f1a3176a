"""Part 4: the CUDA figures, with kvcached's A100 anchors beside them.

Why these: a grant is page creation (kept off the hot path), mapping and
access rights per page, and a scrub when a page changes engine; kvcached
published the per-call costs on an A100, so the same calls are timed here
one by one (p50/p99 over ``PAGES`` pages of 2 MiB, several rounds, the first
discarded as warm-up), plus what batching buys (map N pages, then one
``cuMemSetAccess`` over the whole range), the zeroing bandwidth of the
backend's scrub against ``torch.zero_`` on the same memory, and a grant end
to end (engine -> daemon -> worker mapped -> grant) through a real daemon,
beside each of its calls timed alone (``grantphases.py``: create, export,
transfer, import, map), so the report says what the protocol, the loop and
the acknowledgement take.

Then what moving memory between engines costs: ``recycling`` (per page, a
fresh page -- release + create, what the daemon does -- against zeroing the
old one in place, batched creation, and what a descriptor kept by the old
owner shows after each: why the daemon pays for fresh pages), ``handoff``
(a demand grant that must first reclaim another engine's idle cached slab,
beside the raw map of the same run) and ``devices`` (a page, an arena and a
tensor on the second GPU; a first-GPU page refused by its arena).

Without a GPU (host mode) it runs a quick smoke of the same code on host
pages, so the kit cannot rot; those figures say nothing about a GPU.

``python -m kvelastic_tools.gpucheck.cudabench BACKEND`` prints one JSON object on
its last line.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvelastic.vmm import get_backend
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE, Backend
from kvelastic.vmm.errors import PageMismatch
from kvelastic_tools.figures import percentile
from kvelastic_tools.gpucheck import grantphases, tierbench

# kvcached (ovg-project), CUDA VMM on an A100, microseconds per 2 MiB page.
ANCHORS_US = {"cuMemCreate": 193.0, "cuMemMap": 1.45, "cuMemSetAccess": 36.0, "cuMemUnmap": 25.6}
ANCHOR_SOURCE = "kvcached (ovg-project), NVIDIA A100, per 2 MiB page"
PAGES = 128
ROUNDS = 4


def pct(samples_ns: list[int], q: float) -> float:
    """The q-quantile of nanosecond samples, in microseconds."""
    return round(percentile(samples_ns, q) / 1000.0, 3)


def _stats(samples_ns: list[int]) -> dict[str, float]:
    return {"p50_us": pct(samples_ns, 0.5), "p99_us": pct(samples_ns, 0.99), "n": len(samples_ns)}


def _timed(fn: Callable[..., Any], out: list[int], *args: Any) -> Any:
    """``fn(*args)``, its time appended to ``out``."""
    t0 = time.perf_counter_ns()
    result = fn(*args)
    out.append(time.perf_counter_ns() - t0)
    return result


def driver_calls(backend: Backend, pages: int = PAGES, rounds: int = ROUNDS) -> dict[str, Any]:
    """Each VMM call timed alone, with the backend's allocation properties
    (POSIX-fd shareable pages on the backend's device)."""
    from kvelastic.vmm.cuda import _driver, check

    d = _driver()
    ps = backend.page_size
    prop, access = backend._prop, backend._access  # type: ignore[attr-defined]
    backend.make_current()
    t: dict[str, list[int]] = {k: [] for k in ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                                               "cuMemRelease")}
    handles = [_timed(lambda: check("cuMemCreate", d.cuMemCreate(ps, prop, 0)), t["cuMemCreate"])
               for _ in range(pages)]
    base = int(check("cuMemAddressReserve", d.cuMemAddressReserve(pages * ps, ps, 0, 0)))
    batched: list[int] = []
    batched_unmap: list[int] = []
    batch_error = ""
    try:
        for r in range(rounds + 1):
            m: list[int] = []
            a: list[int] = []
            u: list[int] = []
            for i, h in enumerate(handles):
                _timed(lambda i, h: check("cuMemMap", d.cuMemMap(base + i * ps, ps, 0, h, 0)), m, i, h)
            for i in range(pages):
                _timed(lambda i: check("cuMemSetAccess", d.cuMemSetAccess(base + i * ps, ps, access, 1)), a, i)
            for i in range(pages):
                _timed(lambda i: check("cuMemUnmap", d.cuMemUnmap(base + i * ps, ps)), u, i)
            if r:  # round 0 is warm-up
                t["cuMemMap"] += m
                t["cuMemSetAccess"] += a
                t["cuMemUnmap"] += u
        try:  # batched: map every page, then one access call over the whole range
            for r in range(rounds + 1):
                t0 = time.perf_counter_ns()
                for i, h in enumerate(handles):
                    check("cuMemMap", d.cuMemMap(base + i * ps, ps, 0, h, 0))
                check("cuMemSetAccess", d.cuMemSetAccess(base, pages * ps, access, 1))
                t1 = time.perf_counter_ns()
                for i in range(pages):
                    check("cuMemUnmap", d.cuMemUnmap(base + i * ps, ps))
                t2 = time.perf_counter_ns()
                if r:
                    batched.append((t1 - t0) // pages)
                    batched_unmap.append((t2 - t1) // pages)
        except Exception as exc:  # noqa: BLE001 - an optional figure: report it, keep the others
            batch_error = f"{type(exc).__name__}: {exc}"
            for i in range(pages):
                d.cuMemUnmap(base + i * ps, ps)
    finally:
        d.cuMemAddressFree(base, pages * ps)
        for h in handles:
            _timed(lambda h: check("cuMemRelease", d.cuMemRelease(h)), t["cuMemRelease"], h)
    per_call = {name: _stats(samples) for name, samples in t.items()}
    single = per_call["cuMemMap"]["p50_us"] + per_call["cuMemSetAccess"]["p50_us"]
    batch = pct(batched, 0.5) if batched else 0.0
    return {
        "pages": pages, "rounds": rounds, "page_size": ps, "per_page": per_call,
        "anchors_us": ANCHORS_US, "anchor_source": ANCHOR_SOURCE,
        "ratio_to_anchor_p50": {k: round(per_call[k]["p50_us"] / v, 3) for k, v in ANCHORS_US.items()},
        "batched": {"error": batch_error} if batch_error else {
            "pages": pages, "map_plus_one_access_per_page_us": batch,
            "unmap_per_page_us": pct(batched_unmap, 0.5),
            "map_plus_access_one_by_one_p50_us": round(single, 3),
            "speedup": round(single / batch, 2) if batch else None},
    }


def zeroing(backend: Backend, pages: int = 64, rounds: int = 3) -> dict[str, Any]:
    """GB/s of the backend's scrub (per page, as the daemon does it) against
    ``torch.zero_`` over the same mapped memory; and that the scrub zeroes."""
    import torch

    ps = backend.page_size
    cuda = backend.name == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    handles = [backend.create_page() for _ in range(pages)]
    arena = backend.reserve(pages * ps)
    out: dict[str, Any] = {"pages": pages, "bytes": pages * ps}
    try:
        for i, page in enumerate(handles):
            arena.map(i * ps, page)
        view = arena.tensor(torch.uint8, (pages * ps,))
        scrub, whole, by_page = [], [], []
        zeroed = True
        for _ in range(rounds):
            view.fill_(0xAB)
            sync()
            t0 = time.perf_counter()
            for page in handles:
                backend.zero(page)
            scrub.append(time.perf_counter() - t0)
            zeroed &= int(view.count_nonzero()) == 0
            view.fill_(1)
            sync()
            t0 = time.perf_counter()
            view.zero_()
            sync()
            whole.append(time.perf_counter() - t0)
            view.fill_(1)
            sync()
            t0 = time.perf_counter()
            for i in range(pages):
                view[i * ps:(i + 1) * ps].zero_()
            sync()
            by_page.append(time.perf_counter() - t0)
        del view

        def gbps(seconds: list[float]) -> float:
            return round(pages * ps / sorted(seconds)[len(seconds) // 2] / 1e9, 2)

        out.update(zeroed=zeroed, backend_zero_gbps=gbps(scrub), torch_zero_gbps=gbps(whole),
                   torch_zero_per_page_gbps=gbps(by_page))
        out["backend_over_torch"] = round(out["backend_zero_gbps"] / out["torch_zero_gbps"], 3)
    finally:
        arena.close()
        for page in handles:
            backend.release_page(page)
    return out


def grant_latency(backend: str, rounds: int, engines: int) -> dict[str, Any]:
    """Grow -> Granted (the worker mapped the page) and Return -> reply, p50/p99."""
    from kvelastic_tools.bench import grant
    from kvelastic_tools.bench.daemon import running_daemon

    out: dict[str, Any] = {"rounds": rounds, "pages_per_slab": 1}
    with tempfile.TemporaryDirectory(prefix="gpucheck-grant-") as tmp, \
            running_daemon(tmp, "256MiB", backend) as sock:
        runs = {"1_engine": grant.engine_loop(sock, "gpucheck-solo", rounds, backend)}
        if engines:
            runs[f"{engines}_engines"] = grant._parallel(sock, engines, max(10, rounds // 4), backend)
    for label, data in runs.items():
        out[label] = {f"{kind}_{q}_us": round(percentile(data[kind], p), 1)
                      for kind in ("grant", "return") for q, p in (("p50", 0.5), ("p99", 0.99))}
    return out


def handoff_latency(backend: str, rounds: int, figures: dict[str, Any]) -> dict[str, Any]:
    """Demand grant through a reclaim (``bench/handoff.py``), beside the raw
    page map measured earlier in this run (``arena_vs_raw``)."""
    from kvelastic_tools.bench import handoff

    out = handoff.measure(backend, rounds)
    raw = (figures.get("arena_vs_raw") or {}).get("raw_map_p50_us")
    return handoff.with_raw(out, raw) if raw else out


def two_devices(backend: Backend) -> dict[str, Any]:
    """On a second GPU: a page, an arena, a torch tensor over it (new page
    reads zero, a write reads back), and a first-GPU page refused by the
    second GPU's arena (``PageMismatch``, before any driver call)."""
    if backend.name != "cuda":
        return {"status": "skipped", "why": "no GPU"}
    import torch

    count = min(backend.device_count(), torch.cuda.device_count())  # type: ignore[attr-defined]
    if count < 2:
        return {"status": "skipped", "why": f"{count} device"}
    ps = backend.page_size
    second = get_backend("cuda", ps, device=1)
    page1, page0 = second.create_page(), backend.create_page()
    out: dict[str, Any] = {"status": "passed", "devices": count}
    try:
        with second.reserve(2 * ps) as arena:
            arena.map(0, page1)
            view = arena.tensor(torch.uint8, (ps,))
            out["tensor_device"] = str(view.device)
            out["new_page_zero"] = int(view.count_nonzero()) == 0
            view.fill_(0x3C)
            second.synchronize()
            out["write_reads_back"] = int((view == 0x3C).sum()) == ps
            del view
            try:
                arena.map(ps, page0)
            except PageMismatch:
                out["foreign_page_refused"] = True
            else:
                arena.unmap(ps)
                out["foreign_page_refused"] = False
            arena.unmap(0)
    finally:
        second.release_page(page1)
        backend.release_page(page0)
        second.close()
        backend.make_current()   # the first GPU's context again for this thread
    bad = [k for k in ("new_page_zero", "write_reads_back", "foreign_page_refused") if not out[k]]
    if out["tensor_device"] != "cuda:1":
        bad.append("tensor_device")
    if bad:
        out["status"] = "failed"
        out["error"] = f"second device: {', '.join(bad)} wrong"
    return out


def _guarded(figures: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """One group of figures; an error is recorded (and fails the part) without losing the rest."""
    try:
        figures[name] = fn()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, the part is marked failed
        figures[name] = {"error": f"{type(exc).__name__}: {exc}"}


def main(backend_name: str) -> dict[str, Any]:
    from kvelastic_tools.bench import vmm

    started = time.perf_counter()
    figures: dict[str, Any] = {}
    backend = get_backend(backend_name, DEFAULT_PAGE_SIZE)
    if backend_name == "cuda":
        _guarded(figures, "driver", lambda: driver_calls(backend))
        _guarded(figures, "zeroing", lambda: zeroing(backend))
        _guarded(figures, "arena_vs_raw", lambda: vmm.bench_cuda(backend, 20))
        _guarded(figures, "grant", lambda: grant_latency("cuda", 300, 4))
        _guarded(figures, "grant_phases", lambda: grantphases.grant_phases(backend, 1, 100))
        _guarded(figures, "recycling", lambda: vmm.bench_recycle(backend, 64, 4, (16, 64)))
        _guarded(figures, "handoff", lambda: handoff_latency("cuda", 100, figures))
        _guarded(figures, "tier", lambda: tierbench.tier_bandwidth(backend))
    else:  # smoke on host pages: the same code paths, quick, no GPU figures
        _guarded(figures, "arena_vs_raw", lambda: vmm.bench_host(backend, 3))
        _guarded(figures, "zeroing", lambda: zeroing(backend, pages=16, rounds=1))
        _guarded(figures, "grant", lambda: grant_latency("host", 20, 0))
        _guarded(figures, "grant_phases", lambda: grantphases.grant_phases(backend, 1, 10))
        _guarded(figures, "recycling", lambda: vmm.bench_recycle(backend, 16, 2, (16,)))
        _guarded(figures, "handoff", lambda: handoff_latency("host", 10, figures))
        _guarded(figures, "tier", lambda: tierbench.tier_bandwidth(backend, pages=8, rounds=1))
    if "error" not in figures.get("grant_phases", {"error": ""}):
        figures["grant_phases"]["against_grant"] = grantphases.unaccounted(figures["grant_phases"],
                                                                           figures.get("grant", {}))
    _guarded(figures, "devices", lambda: two_devices(backend))   # last: it switches the thread's context
    backend.close()
    figures["seconds"] = round(time.perf_counter() - started, 2)
    return figures


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "host")))
