"""Map/unmap latency per page: the backend against the raw calls, same run.

Each round maps ``SLOTS`` pre-created pages into consecutive slots, then
unmaps them all (the grow/shrink pattern of the daemon), once through the
backend's arena and once through the bare system/driver calls on a second
reservation; the two paths alternate which goes first. Every call is timed on
its own. Neither path touches the pages, so the figures are the mapping cost
alone (the first touch is the same page fault for both).

Raw baselines: host, ``mmap(MAP_FIXED|MAP_SHARED)`` of the memfd and
``mmap(MAP_FIXED, PROT_NONE)`` anonymous to re-reserve; cuda, ``cuMemMap`` +
``cuMemSetAccess`` and ``cuMemUnmap`` on pre-created handles. On cuda the
cost of page creation is reported too (``create_*``: the backend's
``create_page``, i.e. ``cuMemCreate`` plus the zeroing of the new page): it is
paid when pages are created, never on the mapping path.

``iterations`` is the number of timed calls per path and operation.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from kvelastic.figures import percentile
from kvelastic.vmm import get_backend
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE, Backend

SLOTS = 64
_ROUNDS = {True: 20, False: 800}


def _us(samples_ns: list[int], q: float) -> float:
    """The q-quantile of nanosecond samples, in microseconds."""
    return percentile(samples_ns, q) / 1000.0


def _summary(timings: dict[str, list[int]], backend: str, page_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": backend, "page_size": page_size}
    for op in ("map", "unmap"):
        mine, raw = timings[op], timings["raw_" + op]
        out[f"{op}_p50_us"] = round(_us(mine, 0.5), 3)
        out[f"{op}_p99_us"] = round(_us(mine, 0.99), 3)
        out[f"raw_{op}_p50_us"] = round(_us(raw, 0.5), 3)
        out[f"raw_{op}_p99_us"] = round(_us(raw, 0.99), 3)
        out[f"{op}_ratio_p50"] = round(_us(mine, 0.5) / _us(raw, 0.5), 3)
    out["iterations"] = len(timings["map"])
    return out


def _measure(
    rounds: int,
    backend_map: Callable[[int], object],    # what each returns is ignored (unmap: the page)
    backend_unmap: Callable[[int], object],
    raw_map: Callable[[int], object],
    raw_unmap: Callable[[int], object],
) -> dict[str, list[int]]:
    timings: dict[str, list[int]] = {"map": [], "unmap": [], "raw_map": [], "raw_unmap": []}
    clock = time.perf_counter_ns
    slots = range(SLOTS)

    def batch(fn: Callable[[int], object], out: list[int]) -> None:
        for i in slots:
            t0 = clock()
            fn(i)
            out.append(clock() - t0)

    paths = [
        (backend_map, backend_unmap, timings["map"], timings["unmap"]),
        (raw_map, raw_unmap, timings["raw_map"], timings["raw_unmap"]),
    ]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds + 1):
            order = paths if r % 2 == 0 else paths[::-1]
            for do_map, _, map_out, _ in order:
                batch(do_map, map_out)
            for _, do_unmap, _, unmap_out in order:
                batch(do_unmap, unmap_out)
            if r == 0:  # warm-up round: first-use costs (page tables, caches) are not the steady state
                for samples in timings.values():
                    samples.clear()
    finally:
        if gc_was_enabled:
            gc.enable()
    return timings


def bench_host(backend: Backend, rounds: int) -> dict[str, Any]:
    from kvelastic.vmm import _libc

    ps = backend.page_size
    pages = [backend.create_page() for _ in range(SLOTS)]
    arena = backend.reserve(SLOTS * ps)
    raw_base = _libc.reserve(SLOTS * ps, ps)
    try:
        mmap = _libc.mmap
        fds = [p.fd for p in pages]  # type: ignore[attr-defined]
        prot_rw, map_page = _libc.PROT_RW, _libc.MAP_PAGE
        prot_none, map_reserve = _libc.PROT_NONE, _libc.MAP_RESERVE_FIXED

        def raw_map(i: int) -> None:
            addr = raw_base + i * ps
            if mmap(addr, ps, prot_rw, map_page, fds[i], 0) != addr:
                raise _libc.failed("mmap")

        def raw_unmap(i: int) -> None:
            addr = raw_base + i * ps
            if mmap(addr, ps, prot_none, map_reserve, -1, 0) != addr:
                raise _libc.failed("mmap")

        timings = _measure(
            rounds,
            lambda i: arena.map(i * ps, pages[i]),
            lambda i: arena.unmap(i * ps),
            raw_map,
            raw_unmap,
        )
    finally:
        arena.close()
        _libc.release(raw_base, SLOTS * ps)
        for page in pages:
            backend.release_page(page)
    return _summary(timings, "host", ps)


def bench_cuda(backend: Backend, rounds: int) -> dict[str, Any]:
    from kvelastic.vmm.cuda import _driver, check

    d = _driver()
    ps = backend.page_size
    create: list[int] = []
    release: list[int] = []
    pages = []
    for _ in range(SLOTS):
        t0 = time.perf_counter_ns()
        pages.append(backend.create_page())
        create.append(time.perf_counter_ns() - t0)
    arena = backend.reserve(SLOTS * ps)
    raw_base = int(check("cuMemAddressReserve", d.cuMemAddressReserve(SLOTS * ps, ps, 0, 0)))
    try:
        handles = [p.handle for p in pages]  # type: ignore[attr-defined]
        access = backend._access  # type: ignore[attr-defined]
        cu_map, cu_access, cu_unmap = d.cuMemMap, d.cuMemSetAccess, d.cuMemUnmap

        def raw_map(i: int) -> None:
            addr = raw_base + i * ps
            (err,) = cu_map(addr, ps, 0, handles[i], 0)
            if err:
                raise RuntimeError(err)
            (err,) = cu_access(addr, ps, access, 1)
            if err:
                raise RuntimeError(err)

        def raw_unmap(i: int) -> None:
            (err,) = cu_unmap(raw_base + i * ps, ps)
            if err:
                raise RuntimeError(err)

        timings = _measure(
            rounds,
            lambda i: arena.map(i * ps, pages[i]),
            lambda i: arena.unmap(i * ps),
            raw_map,
            raw_unmap,
        )
    finally:
        arena.close()
        d.cuMemAddressFree(raw_base, SLOTS * ps)
        for page in pages:
            t0 = time.perf_counter_ns()
            backend.release_page(page)
            release.append(time.perf_counter_ns() - t0)
    out = _summary(timings, "cuda", ps)
    out["create_p50_us"] = round(_us(create, 0.5), 3)
    out["create_p99_us"] = round(_us(create, 0.99), 3)
    out["release_p50_us"] = round(_us(release, 0.5), 3)
    # How many page maps one cuMemCreate costs: why pages are pre-created.
    out["create_over_map_p50"] = round(out["create_p50_us"] / out["map_p50_us"], 1)
    return out


def run(quick: bool = False, backend: str = "auto") -> dict[str, Any]:
    rounds = _ROUNDS[bool(quick)]
    chosen = get_backend(backend, DEFAULT_PAGE_SIZE)
    started = time.perf_counter()
    if chosen.name == "cuda":
        result = bench_cuda(chosen, rounds)
        result["host"] = bench_host(get_backend("host", DEFAULT_PAGE_SIZE), rounds)
    else:
        result = bench_host(chosen, rounds)
    chosen.close()
    result["slots"] = SLOTS
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result
