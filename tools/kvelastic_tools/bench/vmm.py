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

``recycle`` (``bench_recycle``): what handing a used page to another engine
costs per page, both ways, same run -- *fresh* (release it, create a new one:
what the daemon does) and *in place* (``zero`` the old one) -- plus batched
creation (``create_pages``), and what a descriptor kept by the old owner
shows after each way (the reason the daemon pays for fresh pages).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

from kvelastic.vmm import get_backend
from kvelastic.vmm.base import DEFAULT_PAGE_SIZE, Arena, Backend, Page
from kvelastic_tools.figures import percentile

SLOTS = 64
_ROUNDS = {True: 20, False: 800}
# Recycling: (pages, rounds, batch sizes) for quick and full runs.
_RECYCLE = {True: (16, 2, (16,)), False: (64, 4, (16, 64))}
OLD, NEW = 0xA5, 0x5A   # bytes of the page's old owner and of its next one
RECYCLE_WHY = (
    "the daemon gives a fresh page on every move between engines (DESIGN invariant 6): a worker that kept a "
    "duplicate descriptor of its page would read the next owner's bytes if the page were zeroed in place and "
    "reused; with a fresh page it only ever sees its own old bytes (isolation_fresh), whatever it costs "
    "against in_place")


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
    pages, recycle_rounds, batches = _RECYCLE[bool(quick)]
    if chosen.name == "cuda":
        result = bench_cuda(chosen, rounds)
        result["recycle"] = bench_recycle(chosen, pages, recycle_rounds, batches)
        host = get_backend("host", DEFAULT_PAGE_SIZE)
        result["host"] = bench_host(host, rounds)
        result["host"]["recycle"] = bench_recycle(host, pages, recycle_rounds, batches)
    else:
        result = bench_host(chosen, rounds)
        result["recycle"] = bench_recycle(chosen, pages, recycle_rounds, batches)
    chosen.close()
    result["slots"] = SLOTS
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def _write(backend: Backend, arena: Arena, pages: list[Page], value: int) -> None:
    """Map ``pages`` at the arena's first slots, fill them with ``value``, unmap."""
    import torch

    ps = backend.page_size
    for i, page in enumerate(pages):
        arena.map(i * ps, page)
    try:
        view = arena.tensor(torch.uint8, (len(pages) * ps,))
        view.fill_(value)
        backend.synchronize()
        del view
    finally:
        for i in range(len(pages)):
            arena.unmap(i * ps)


def _shows(backend: Backend, arena: Arena, page: Page) -> str:
    """What ``page`` holds: "own" (all OLD), "zeros", or "other" (anything else)."""
    import torch

    arena.map(0, page)
    try:
        view = arena.tensor(torch.uint8, (backend.page_size,))
        zeros = int(view.count_nonzero()) == 0
        own = not zeros and bool((view == OLD).all())
        del view
    finally:
        arena.unmap(0)
    return "own" if own else "zeros" if zeros else "other"


def isolation(backend: Backend, fresh: bool) -> str:
    """A worker keeps a duplicate descriptor of its page (as a hostile one
    could) and writes OLD; the page goes to the next owner, who writes NEW --
    as a fresh page (``fresh``) or zeroed in place. What the kept descriptor
    shows afterwards: "own" means the next owner's bytes are out of its reach."""
    ps = backend.page_size
    page = backend.create_page()
    nxt: Page | None = None
    kept = backend.export(page)
    try:
        with backend.reserve(ps) as arena:
            _write(backend, arena, [page], OLD)
            if fresh:
                backend.release_page(page)
                nxt = backend.create_page()
            else:
                backend.zero(page)
                nxt = page
            _write(backend, arena, [nxt], NEW)
            stale = backend.import_page(os.dup(kept))
            try:
                return _shows(backend, arena, stale)
            finally:
                backend.release_page(stale)
    finally:
        os.close(kept)
        for p in (page, nxt):
            if p is not None and not p.closed:
                backend.release_page(p)


def bench_recycle(backend: Backend, pages: int = 64, rounds: int = 4,
                  batches: tuple[int, ...] = (16, 64)) -> dict[str, Any]:
    """Per page, same run: fresh (release + create; on cuda create includes the
    scrub) against in place (``zero``), each on pages the old owner wrote;
    ``create_pages(n)`` per page for each batch size n (its pages must read
    zero though they may reuse the memory just released); the isolation of
    each way. Round 0 of each is warm-up."""
    clock = time.perf_counter_ns
    ps = backend.page_size
    t: dict[str, list[int]] = {"release": [], "create": [], "fresh": [], "in_place": []}
    held = backend.create_pages(pages)
    arena = backend.reserve(max(pages, *batches) * ps)
    batched: dict[str, float] = {}
    batched_zeroed = True
    try:
        for r in range(rounds + 1):
            _write(backend, arena, held, OLD)
            zero = []
            for page in held:
                t0 = clock()
                backend.zero(page)
                zero.append(clock() - t0)
            _write(backend, arena, held, OLD)
            rel, cre = [], []
            for i, page in enumerate(held):
                t0 = clock()
                backend.release_page(page)
                t1 = clock()
                held[i] = backend.create_page()
                cre.append(clock() - t1)
                rel.append(t1 - t0)
            if r:
                t["in_place"] += zero
                t["release"] += rel
                t["create"] += cre
                t["fresh"] += [a + b for a, b in zip(rel, cre)]
        for n in batches:
            per_page = []
            for r in range(rounds + 1):
                last = r == rounds
                if last:   # dirty memory that the next creation may get back: it must still read zero
                    _write(backend, arena, held[:n], OLD)
                for page in held[:n]:
                    backend.release_page(page)
                t0 = clock()
                got = backend.create_pages(n)
                per_page.append((clock() - t0) // n)
                held[:n] = got
                if last:
                    batched_zeroed &= len({id(p) for p in got}) == n and all(
                        _shows(backend, arena, p) == "zeros" for p in got)
            batched[str(n)] = round(_us(per_page[1:], 0.5), 3)
    finally:
        arena.close()
        for page in held:
            if not page.closed:
                backend.release_page(page)
    out: dict[str, Any] = {"backend": backend.name, "pages": pages, "rounds": rounds}
    for name in ("fresh", "in_place", "release", "create"):
        out[f"{name}_p50_us"] = round(_us(t[name], 0.5), 3)
        out[f"{name}_p99_us"] = round(_us(t[name], 0.99), 3)
    out["fresh_over_in_place_p50"] = round(out["fresh_p50_us"] / out["in_place_p50_us"], 2)
    out["batched_create_per_page_us"] = {"1": out["create_p50_us"], **batched}
    out["batched_zeroed"] = batched_zeroed
    out["isolation_fresh"] = isolation(backend, fresh=True)
    out["isolation_in_place"] = isolation(backend, fresh=False)
    out["chosen"] = "fresh"
    out["why"] = RECYCLE_WHY
    problems = [] if batched_zeroed else ["create_pages gave pages that do not read zero"]
    if out["isolation_fresh"] != "own":
        problems.append(f"a kept descriptor of a replaced page shows {out['isolation_fresh']}, not its own bytes")
    if problems:   # the figures stay; the error key fails the kit's part 4
        out["error"] = "; ".join(problems)
    return out
