"""Part 3: KV correctness on the device, with a real daemon and two engines.

Why: the memory tests show that bytes survive a map; serving needs more -- a
paged-attention computation over KV that lives in arena pages must give the
same result, bit for bit, as over an ordinary allocation, and must keep doing
so while the daemon moves pages between engines. The flow:

1. Engine A (namespace a) grows 6 slabs, fills every block with seeded K/V
   (new blocks must read zero first) and runs paged attention over the arena
   and over a reference tensor: bitwise equal.
2. A caches and frees 2 slabs; engine B (namespace b) demands 4 slabs: 2 new
   pages plus 2 reclaimed from A, which reach B as fresh pages.
   B's new blocks read zero, B fills them and attends: bitwise equal.
3. A's worker unmapped the reclaimed pages (its views cannot reach them); A's
   remaining KV still gives the same bits as in step 1. What a descriptor A
   kept of a lost page shows is recorded: A's old bytes means a fresh page on
   every move (invariant 6); B's bytes would mean the daemon reused the page
   -- reported as *pending*, not as a failure (a daemon older than the fresh
   page rule).
4. B leaves; A grows into B's old pages: they read zero, A fills and attends.

Along the way A captures paged attention as a CUDA graph after step 1 (eager
without a GPU) and replays it: over blocks mapped before the capture, again
after losing two slabs to B, and in step 4 over slabs mapped after the
capture -- each replay equal to the reference, the arena never moved. A
third engine captures before it holds any slab, over the warm-up scratch
(vLLM's order with CUDA graphs), then replays over the pages granted later.

``python -m kvelastic_tools.gpucheck.kvcheck BACKEND`` prints one JSON object on its
last line: ``{"checks": [{"name", "ok", "detail"}], "pending": [...], "figures"}``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvelastic_tools.bench.daemon import running_daemon

CALL_TIMEOUT = 60.0


class PeerError(RuntimeError):
    """An engine process died, hung past its deadline, or reported an error."""


class Peer:
    """A ``kvpeer`` engine process driven over JSON lines, every call with a deadline."""

    def __init__(self, socket_path: str, engine_id: str, namespace: str, seed: int, backend: str) -> None:
        self.name = engine_id
        cfg = {"socket": socket_path, "engine_id": engine_id, "namespace": namespace, "seed": seed,
               "backend": backend}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvelastic_tools.gpucheck.kvpeer", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdin is None or self.proc.stdout is None:   # never with PIPE; typed for the checker
            raise PeerError(f"engine {engine_id}: no pipes to its process")
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.hello = self._read(CALL_TIMEOUT)

    def _read(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self.stdout], [], [], timeout)
        line = self.stdout.readline() if ready else ""
        if not line:
            self.kill()
            raise PeerError(f"engine {self.name}: no answer within {timeout:.0f} s (exit {self.proc.poll()})")
        out = json.loads(line)
        if "error" in out:
            raise PeerError(f"engine {self.name}: {out['error']}")
        return out

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **args: Any) -> dict[str, Any]:
        self.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


class Checks:
    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool, detail: Any = None) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return bool(ok)


def wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def run_flow(sock: str, backend: str, c: Checks) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    a = Peer(sock, "kv-a", "model-a", 1, backend)
    b: Peer | None = None
    try:
        figures["blocks_per_slab"] = a.hello["blocks_per_slab"]
        grown = a.call("grow", slabs=6)
        c.add("A grows 6 slabs", grown["ok"] and len(grown["slabs"]) == 6, grown)
        filled = a.call("fill")
        c.add("A's new blocks read zero before A writes", filled["zero_before"], filled["blocks"])
        first = a.call("attend")
        c.add("A: paged attention over arena KV == over an ordinary allocation, bitwise",
              first["equal"] and first["sequences"] >= 3, first)

        cap = a.call("capture", blocks=figures["blocks_per_slab"])
        figures["graph"] = cap["graph"]
        c.add(f"A captures paged attention over arena KV ({cap['graph']}) over blocks of {len(cap['slabs_at_capture'])}"
              " mapped slabs", cap["blocks"] == figures["blocks_per_slab"], cap)
        replayed = a.call("replay", after_capture=False)
        c.add("graph replay over blocks mapped before the capture == reference", replayed["equal"]
              and replayed["kv_address_unchanged"], replayed)
        released = a.call("release", slabs=2)["released"]
        b = Peer(sock, "kv-b", "model-b", 2, backend)
        got = b.call("grow", slabs=4)
        c.add("B gets 4 slabs: 2 new pages + 2 reclaimed from A", got["ok"] and len(got["slabs"]) == 4, got)
        b_fill = b.call("fill")
        c.add("B's new blocks (2 slabs taken from A) read zero before B writes", b_fill["zero_before"],
              b_fill["blocks"])
        b_first = b.call("attend")
        c.add("B: paged attention over arena KV == reference, bitwise", b_first["equal"], b_first)

        lost: dict[str, Any] = {}

        def all_lost() -> bool:          # reclaim acks may trail B's grant by a tick
            lost.update(a.call("forget_lost"))
            return len(lost["lost"]) >= len(released)

        wait_until(all_lost, 10.0)
        c.add("A lost exactly the slabs it released", sorted(x["slab"] for x in lost["lost"]) == released,
              {"released": released, "lost": [x["slab"] for x in lost["lost"]]})
        c.add("A's worker unmapped every reclaimed page (its views cannot reach B's KV)",
              all(x["unmapped_here"] for x in lost["lost"]), lost["lost"])
        again = a.call("attend")
        c.add("A's remaining KV gives the same bits as before B wrote", again["equal"] and again["stable"]
              and again["sequences"] >= 1, again)
        replayed = a.call("replay", after_capture=False)
        c.add("graph replay after A lost 2 slabs to B (unmapped under the graph) == reference",
              replayed["equal"] and replayed["kv_address_unchanged"], replayed)
        b_hashes = set(b.call("hashes")["hashes"].values())
        stale = [x["stale"] if x["stale_hash"] not in b_hashes else "B's data" for x in lost["lost"]]
        figures["stale_descriptor_shows"] = stale
        fresh = all(s == "own" for s in stale)
        if not fresh:
            c.pending.append({"name": "a page that moves to another engine is a fresh physical page "
                                      "(DESIGN invariant 6)",
                              "detail": f"a descriptor kept by A of a reclaimed page shows {stale}: the daemon "
                                        "zeroes and reuses pages across engines today"})
        c.add("a kept descriptor never shows anything but A's own bytes or B's zeroed-then-written page",
              all(s in ("own", "B's data", "zeros") for s in stale), stale)
        b_again = b.call("attend")
        c.add("B recomputes: equal and stable", b_again["equal"] and b_again["stable"], b_again)

        b.close()
        b = None
        regrow = a.call("grow", slabs=2, keep_cache=True)
        c.add("A grows into B's former pages after B left", regrow["ok"], regrow)
        refill = a.call("fill")
        c.add("A's new blocks after B left read zero before A writes (nothing of B's KV)", refill["zero_before"],
              refill["blocks"])
        replayed = a.call("replay", after_capture=True)
        c.add("graph replay over slabs mapped after the capture (new pages, same addresses) == reference",
              replayed["equal"] and replayed["kv_address_unchanged"], replayed)
        figures["graph_bitwise"] = replayed["bitwise"]
        final = a.call("attend")
        c.add("A: every sequence again bitwise equal to the reference, earlier ones unchanged",
              final["equal"] and final["stable"], final)
    finally:
        for peer in (b, a):
            if peer is not None:
                peer.close()
    return figures


def early_capture_flow(sock: str, backend: str, c: Checks) -> None:
    """vLLM's order: graphs captured before the engine holds a slab (over the
    warm-up scratch), the daemon's pages mapped afterwards, replays exact."""
    e = Peer(sock, "kv-early", "model-early", 3, backend)
    try:
        bps = e.hello["blocks_per_slab"]
        cap = e.call("capture_early", blocks=bps)
        c.add(f"a graph ({cap['graph']}) captured before any slab, over {cap['scratch_slots']} scratch-backed "
              "slots; none stays mapped", cap["scratch_slots"] > 0 and cap["mapped_after"] == 0, cap)
        grown = e.call("grow", slabs=2)
        filled = e.call("fill")
        c.add("the engine's first slabs arrive after the capture and read zero (no warm-up bytes)",
              grown["ok"] and filled["zero_before"], filled)
        replayed = e.call("replay", after_capture=True)
        c.add("the early graph replays over the daemon's pages == reference", replayed["equal"]
              and replayed["kv_address_unchanged"], replayed)
    finally:
        e.close()


def main(backend: str) -> dict[str, Any]:
    c = Checks()
    started = time.perf_counter()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvcheck-") as tmp:
        try:
            with running_daemon(tmp, "16MiB", backend) as sock:
                figures = run_flow(sock, backend, c)
                early_capture_flow(sock, backend, c)
        except PeerError as exc:
            c.add("the flow ran to the end", False, str(exc))
    figures["seconds"] = round(time.perf_counter() - started, 2)
    return {"checks": c.checks, "pending": c.pending, "figures": figures}


if __name__ == "__main__":
    os.environ.setdefault("KVELASTIC_LOG_LEVEL", "warning")
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "host")))
