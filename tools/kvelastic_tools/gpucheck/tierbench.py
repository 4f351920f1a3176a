"""The GPU kit's tier figures (part 4): demote and promote
bandwidth per 2 MiB page between the backend's pages, mapped in an arena as
an engine's KV is, and pinned host memory (what a GPU node's host tier
holds), against a plain ``cudaMemcpyAsync`` of the same bytes between a
``cudaMalloc`` buffer and the same pinned memory. Page by page, as a
demotion of a block's runs goes: one copy per page, one synchronize per
round. On host pages (no GPU) the same code runs on CPU tensors, a smoke
test of its paths with no GPU figures.
"""

from __future__ import annotations

import time
from typing import Any

from kvelastic.vmm.base import Backend


def tier_bandwidth(backend: Backend, pages: int = 64, rounds: int = 5) -> dict[str, Any]:
    """GB/s, median over ``rounds``: device -> pinned host (demote) and back
    (promote), through the arena's pages and through a plain buffer; and
    whether the bytes came back whole."""
    import torch

    ps = backend.page_size
    cuda = backend.name == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    handles = [backend.create_page() for _ in range(pages)]
    arena = backend.reserve(pages * ps)
    out: dict[str, Any] = {"pages": pages, "page_bytes": ps, "pinned": cuda}
    try:
        for i, page in enumerate(handles):
            arena.map(i * ps, page)
        mapped = arena.tensor(torch.uint8, (pages * ps,))
        plain = torch.empty(pages * ps, dtype=torch.uint8, device=device)
        host = torch.empty(pages * ps, dtype=torch.uint8, pin_memory=cuda)
        pattern = torch.randint(0, 256, (pages * ps,), dtype=torch.uint8, device=device)

        def per_page(dst: torch.Tensor, src: torch.Tensor) -> float:
            sync()
            t0 = time.perf_counter()
            for i in range(pages):
                dst[i * ps:(i + 1) * ps].copy_(src[i * ps:(i + 1) * ps], non_blocking=cuda)
            sync()
            return time.perf_counter() - t0

        times: dict[str, list[float]] = {k: [] for k in ("demote", "promote", "plain_d2h", "plain_h2d")}
        whole = True
        for _ in range(rounds):
            mapped.copy_(pattern)
            plain.copy_(pattern)
            times["demote"].append(per_page(host, mapped))
            whole &= bool(torch.equal(host.to(device), pattern))
            mapped.zero_()
            times["promote"].append(per_page(mapped, host))
            whole &= bool(torch.equal(mapped, pattern))
            times["plain_d2h"].append(per_page(host, plain))
            times["plain_h2d"].append(per_page(plain, host))
        del mapped

        def gbps(seconds: list[float]) -> float:
            return round(pages * ps / sorted(seconds)[len(seconds) // 2] / 1e9, 2)

        figures = {k: gbps(v) for k, v in times.items()}
        out.update(whole=whole, demote_gbps=figures["demote"], promote_gbps=figures["promote"],
                   plain_d2h_gbps=figures["plain_d2h"], plain_h2d_gbps=figures["plain_h2d"],
                   demote_over_plain=round(figures["demote"] / figures["plain_d2h"], 3),
                   promote_over_plain=round(figures["promote"] / figures["plain_h2d"], 3),
                   page_demote_us=round(ps / (figures["demote"] * 1e9) * 1e6, 1),
                   page_promote_us=round(ps / (figures["promote"] * 1e9) * 1e6, 1))
    finally:
        arena.close()
        for page in handles:
            backend.release_page(page)
    return out
