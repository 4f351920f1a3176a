"""``kvelastic bench fuzz``, sequence mode: well-formed protocol sequences
from several clients against a real daemon, then its books.

This module runs it: the fuzzed daemon, the clients (``fuzzsession``, over
``fuzzwire``) for a while with the daemon's health and books watched, the
checks at the end, and ``python -m kvelastic_tools.bench.fuzzseq``.

Why: a frame at a time tests each message's checks; the books break in
sequences of valid messages (an engine id registered again while its last
registration still waits for its workers' unmaps lost 22 of 64 MiB in 44 s).
Each client, a thread, carries out seeded session plans (``fuzzsession``
says which) with type-valid, often extreme values.

Checked, with the daemon a subprocess (host backend):
- it never crashes, nor hangs: a ``Status`` from a process of its own every
  20 ms must be answered within 2 s (its p50/p99/max under attack reported);
- no page is ever lost: at every ``Status`` (every 0.5 s) each page created
  is free, in an engine record's slab or in kept cache (``fuzzdrive.books``);
- once every client has gone and every deadline has passed, nothing is held
  but the legitimate engine's slabs, the daemon's page handles match its
  books, no traceback is in its log, and the legitimate engine beside the
  fuzz (``fuzzdrive.Legit``: the target of the impostors and hostile hellos)
  kept its slabs, data and status and still grows, serves and returns.

Replay: ``python -m kvelastic_tools.bench.fuzzseq --seed N [--quick]`` (JSON). The
seed fixes every client's plans, whatever the daemon answers; the daemon's
timing decides how the clients interleave, so a finding is reproduced by
its seed in distribution, and the report's trace shows what led to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from kvelastic import protocol as p
from kvelastic_tools.bench import fuzzdrive as fd
from kvelastic_tools.bench.daemon import rss_bytes
from kvelastic_tools.bench.fuzzsession import Client
from kvelastic_tools.bench.fuzzwire import Settings, Tally
from kvelastic_tools.fuzz import Sequences

MiB = 1 << 20
BUDGET = "64MiB"
# Deadlines of the fuzzed daemon: short, so that many pass in a short run
# (acks late past them, grows answered at them, kept cache expiring);
# the clients expect the first two (``fuzzwire.ACK_TIMEOUT``, ``GROW_TIMEOUT``).
DAEMON_TIMING = {"KVELASTIC_ACK_TIMEOUT": "2s", "KVELASTIC_GROW_TIMEOUT": "1s", "KVELASTIC_IDLE_GRACE": "1s",
                 "KVELASTIC_ORPHAN_CACHE_TTL": "2s"}
ORPHAN_TTL = 2.0
FROZEN_AFTER = 3                   # probes in a row not answered within 2 s: the daemon is frozen
BOOKS_EVERY = 0.5                  # seconds between checks of the books during the fuzz


# ---------------------------------------------------------------- the run
def drive(settings: Settings, seed: int, clients: int, seconds: float, alive: Callable[[], bool],
          victims: tuple[str, ...] = (), ids: int = 5, log_tail: Callable[[], list[str]] = list) -> dict[str, Any]:
    """Run ``clients`` clients for ``seconds`` against the daemon at
    ``settings.socket_path``, checking its books every ``BOOKS_EVERY`` s.
    ``log_tail``: the daemon's last log lines, shown with a finding."""
    tally, stop = Tally(), threading.Event()
    sequences = Sequences(seed, settings.page_size, settings.budget_bytes, ids=ids, victims=victims,
                          ack_timeout=settings.ack_timeout)
    probe = fd.StatusProbe(settings.socket_path)
    deadline = time.monotonic() + seconds
    threads = [Client(i, settings, sequences, tally, stop, deadline) for i in range(clients)]
    for t in threads:
        t.start()
    out: dict[str, Any] = {"crashed": False, "frozen": False}
    samples, worst, first = 0, 0, None
    try:
        while any(t.is_alive() for t in threads):
            if not alive():
                out["crashed"] = True
                out["trace_before_the_crash"] = tally.snapshot()
                out["log_before_the_crash"] = log_tail()
                break
            unanswered = probe.unanswered_in_a_row()
            if unanswered and "first_hang_at_s" not in out:
                out["first_hang_at_s"] = round(time.monotonic() - tally.t0 - unanswered * probe.timeout, 1)
                out["trace_before_the_first_hang"] = tally.snapshot()
                out["log_before_the_first_hang"] = log_tail()
            if unanswered >= FROZEN_AFTER:
                out["frozen"] = True
                out["trace_before_the_freeze"] = tally.snapshot()
                out["log_before_the_freeze"] = log_tail()
                break
            report = fd.status(settings.socket_path)
            if report is not None:
                samples += 1
                b = fd.books(report)
                if abs(b["unbooked"]) > abs(worst):
                    worst = b["unbooked"]
                if b["unbooked"] and first is None:
                    first = {"at_s": round(time.monotonic() - tally.t0, 2), "books": b,
                             "trace": tally.snapshot(), "daemon_log": log_tail()}
            time.sleep(BOOKS_EVERY)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        figures = probe.stop()
    counts = {group: dict(sorted(c.items())) for group, c in sorted(tally.counts.items())}
    out.update({
        "seconds": round(time.monotonic() - tally.t0, 1), **figures,
        "books_checks": samples, "unbooked_pages_max": worst, "first_unbooked": first,
        "grow_answer_max_s": round(tally.grow_wait_max, 3), "counts": counts})
    return out


@contextlib.contextmanager
def _daemon(folder: str, log: IO[bytes], metrics_port: int,
            pythonpath: str | None = None) -> Iterator[subprocess.Popen]:
    """The fuzzed daemon: host pages, ``BUDGET``, the short ``DAEMON_TIMING``.
    ``pythonpath``: another tree's ``kvelastic`` for the daemon (an older one, to see it fail)."""
    sock = os.path.join(folder, "kvelastic.sock")
    env = dict(os.environ, KVELASTIC_SOCKET=sock, KVELASTIC_MEMORY=BUDGET, KVELASTIC_BACKEND="host",
               KVELASTIC_METRICS_PORT=str(metrics_port), KVELASTIC_METRICS_ADDR="127.0.0.1",
               KVELASTIC_LOG_LEVEL="info", **DAEMON_TIMING)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=pythonpath)    # ``-m`` puts the folder it runs in first
    try:
        deadline = time.monotonic() + 20
        while fd.status(sock, 0.5) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fuzzed daemon did not start")
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:     # frozen: it reads no signal
                proc.kill()
                proc.wait(10)


def settle(socket_path: str, legit_pages: int, timeout: float) -> tuple[dict[str, int] | None, list[str]]:
    """Wait (up to ``timeout``) until nothing is held but the legitimate
    engine's pages, nothing is kept, quarantined or adopted; the books then,
    and who is still registered."""
    deadline = time.monotonic() + timeout
    b: dict[str, int] | None = None
    engines: list[str] = []
    while True:
        report = fd.status(socket_path)
        if report is not None:
            b = fd.books(report)
            engines = sorted(e.engine_id for e in report.engines)
            if engines == [fd.LEGIT_ID] and b["held"] == legit_pages and not (b["orphaned"] or b["quarantined"]
                                                                                 or b["adopted"]):
                return b, engines
        if time.monotonic() > deadline:
            return b, engines
        time.sleep(0.25)


def _tail(path: str, lines: int = 40) -> list[str]:
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
        text = f.read().decode(errors="replace")
    return [line[11:].replace(" kvelastic.daemon:", "") for line in text.splitlines()[-lines:]]


def run(quick: bool = False, seed: int = 0, clients: int | None = None, seconds: float | None = None,
        daemon_pythonpath: str | None = None) -> dict[str, Any]:
    """The sequence section of ``kvelastic bench fuzz``: its own daemon, the
    legitimate engine, ``clients`` clients for ``seconds``, then the checks."""
    clients = clients or (4 if quick else 8)
    seconds = seconds if seconds is not None else (10.0 if quick else 60.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    port = fd.free_port()
    ids = max(5, clients)          # a few engine ids for all the clients: each is reused, often at once
    out: dict[str, Any] = {"seed": seed, "clients": clients, "engine_ids": ids,
                           "daemon": {"budget": BUDGET, **DAEMON_TIMING}}
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "daemon.log")
        with open(log_path, "wb") as log, _daemon(tmp, log, port, daemon_pythonpath) as proc:
            sock = os.path.join(tmp, "kvelastic.sock")
            first = fd.status(sock)
            assert first is not None
            settings = Settings(sock, first.page_size, first.budget_bytes)
            legit = fd.Legit(sock, page_size=first.page_size)
            try:
                rss0 = rss_bytes(proc.pid)
                result = drive(settings, seed, clients, seconds, lambda: proc.poll() is None, victims=(fd.LEGIT_ID,),
                               ids=ids, log_tail=lambda: _tail(log_path))
                out.update(result)
                if not result["crashed"] and not result["frozen"] and all(
                        fd.status(sock) is None for _ in range(FROZEN_AFTER)):
                    out["frozen"] = True              # it stopped answering at the very end
                stuck = out["crashed"] or out["frozen"]
                if not stuck:
                    _, engines = settle(sock, legit.pages_held, settings.ack_timeout + settings.grow_timeout
                                        + ORPHAN_TTL + p.HEARTBEAT_TIMEOUT + 5.0)
                    time.sleep(0.5)                           # stale free pages released, a batch a tick
                    report = fd.status(sock)
                    end = fd.books(report) if report is not None else None
                    if end is not None:
                        out["end"] = {**end, "engines": engines, "legit_pages": legit.pages_held,
                                      "page_handles": fd.page_handles(proc.pid)}
                        # Counted against the budget, yet neither free nor the legitimate engine's.
                        out["pages_lost"] = end["created"] + end["adopted"] - end["free"] - legit.pages_held
                        out["pages_lost_mib"] = round(out["pages_lost"] * settings.page_size / MiB, 1)
                        out["handles_not_in_books"] = out["end"]["page_handles"] - end["created"]
                    out["rss_growth_mib"] = round((rss_bytes(proc.pid) - rss0) / MiB, 1)
                    out["legitimate_engine"] = legit.check()
                stuck = stuck or proc.poll() is not None
            finally:
                legit.close(unregister=proc.poll() is None and not out.get("frozen"))
            out["crashed"] = out["crashed"] or proc.poll() is not None
        out["daemon_log_tracebacks"], first_traceback = fd.tracebacks(log_path)
        if first_traceback:
            out["first_traceback"] = first_traceback
    unbooked = max(abs(out.get("unbooked_pages_max", 0)), abs(out.get("end", {}).get("unbooked", 0)))
    out.setdefault("pages_lost", None)
    out["crashes"] = int(out["crashed"])
    out["hangs"] = out.get("hangs", 0) + int(out["frozen"])
    out["unbooked_pages"] = unbooked
    internal = out["counts"].get("problems", {}).get("internal_errors", 0)
    legit_ok = out.get("legitimate_engine", {}).get("ok", False)
    out["ok"] = (not out["crashes"] and not out["hangs"] and out["pages_lost"] == 0 and not unbooked
                 and not internal and not out["daemon_log_tracebacks"] and legit_ok
                 and not out.get("handles_not_in_books"))
    return out


def _worker_main(socket_path: str, engine_id: str, rank: int, token: str) -> None:
    """A real worker process (``SessionWire.spawn_worker``): it registers, maps and
    acknowledges as vLLM's would, until it is killed."""
    from kvelastic.client.worker import WorkerClient
    from kvelastic.vmm import get_backend

    worker = WorkerClient(get_backend("host"), socket_path=socket_path, engine_id=engine_id, rank=rank,
                          token=bytes.fromhex(token))
    with contextlib.suppress(Exception):
        worker.start(timeout=10)
    threading.Event().wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["worker"]:
        _worker_main(args[1], args[2], int(args[3]), args[4])
        return 0
    parser = argparse.ArgumentParser(prog="python -m kvelastic_tools.bench.fuzzseq",
                                     description="the sequence fuzz of kvelastic bench fuzz, one seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clients", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--daemon-pythonpath", default=None,
                        help="run the daemon from another tree (e.g. an older commit's, to see it fail)")
    ns = parser.parse_args(args)
    print(json.dumps(run(ns.quick, ns.seed, ns.clients, ns.seconds, ns.daemon_pythonpath), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
