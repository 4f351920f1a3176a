"""Helpers for the daemon reliability tests (``test_reliability.py``): processes
that misbehave the way real ones do, and raw clients that misbehave on purpose.

- ``Driver``: an engine or a lone worker in its own process, driven by JSON
  lines like ``tests/daemon/engines.py``'s ``EngineProcess`` (whose ``kill`` and
  ``close`` it keeps), but without torch on the host backend (it starts in a
  fraction of a second), with a deadline on every answer, commands that can be
  sent and answered later (``send``/``recv``) and signals (SIGSTOP a worker in
  the middle of a flow: what a hung or swapped-out process looks like).
  ``{"role": "worker"}`` runs one WorkerClient alone, so its engine keeps
  running while the worker is stopped or killed.
- ``RawEngine``: a hand-written engine on a raw ZMQ DEALER plus its AF_UNIX
  lifeline (the daemon never sees an EngineClient).
- ``slow_hello``: a page-channel client that sends its greeting a byte at a time.
- ``read_process_memory``: what a (stopped) worker's mapping holds, read from
  ``/proc/PID/mem`` without the worker's help.
- ``kv_event_batches``: the daemon's KV event history, through its replay socket.
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import zmq

from kvelastic import protocol as p
from kvelastic.kv_events import KVEventBatch
from tests.daemon.engines import EngineProcess

try:
    from tests.backend import TEST_BACKEND
except ImportError:  # pragma: no cover - older trees: host pages only
    TEST_BACKEND = os.environ.get("KVELASTIC_TEST_BACKEND", "host") or "host"

MiB = 1 << 20
PAGE = 2 * MiB


# ------------------------------------------------------------------- processes
class Driver(EngineProcess):
    """An engine (``role="engine"``, the default) or a lone worker
    (``role="worker"``) of ``engine_id`` in a child process."""

    def __init__(self, socket_path: str, engine_id: str, start_timeout: float = 15.0, **cfg) -> None:
        self.engine_id = engine_id
        self.role = cfg.get("role", "engine")
        cfg.update(socket=socket_path, engine_id=engine_id)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.daemon.hostile", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.recv(start_timeout)
        assert ready.get("ready"), f"{engine_id} did not start: {ready}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 10.0) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.engine_id}: no answer within {timeout} s")
        line = self.proc.stdout.readline()
        assert line, f"{self.engine_id} died"
        return json.loads(line)

    def answered(self) -> bool:
        """An answer is waiting to be read."""
        return bool(select.select([self.proc.stdout], [], [], 0)[0])

    def do(self, op: str, answer_within: float = 15.0, **args) -> dict:
        """One command and its answer (``args`` go to the command: ``timeout``
        is the command's own, e.g. how long ``ensure`` may wait)."""
        self.send(op, **args)
        return self.recv(answer_within)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP, and wait until the kernel shows every thread stopped."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not all(_proc_state(self.pid, tid) in "Tt" for tid in os.listdir(f"/proc/{self.pid}/task")):
            assert time.monotonic() < deadline, f"{self.engine_id} (pid {self.pid}) did not stop"
            time.sleep(0.005)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def close(self) -> None:
        self.signal(signal.SIGCONT)   # a stopped process never reads its stdin's EOF
        super().close()


def _proc_state(pid: int, tid: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:   # a thread that ended
        return "T"


def read_process_memory(pid: int, address: int, nbytes: int = 1) -> bytes:
    """Bytes of another process's address space (works on a stopped process)."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(address)
        return mem.read(nbytes)


# ------------------------------------------------------------- raw clients
def dealer(socket_path: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.setsockopt(zmq.SNDHWM, 0)         # a flood is queued here, never blocked or dropped
    sock.connect(f"ipc://{socket_path}")
    return sock


def timed_status(socket_path: str, timeout: float) -> float:
    """Seconds a ``Status`` took to be answered on a fresh DEALER (``inf``: none
    within ``timeout``)."""
    sock = dealer(socket_path)
    try:
        start = time.monotonic()
        sock.send(p.encode(p.Status(req_id=1)))
        if not sock.poll(int(timeout * 1000)):
            return float("inf")
        reply = p.decode(sock.recv())
        assert isinstance(reply, p.StatusReply), reply
        return time.monotonic() - start
    finally:
        sock.close(0)


class StatusProbe:
    """Asks the daemon for its status over and over from a thread of its own
    (a fresh DEALER each time, like the CLI) and records how long each took."""

    def __init__(self, socket_path: str, timeout: float = 0.5, interval: float = 0.05) -> None:
        self.socket_path, self.timeout, self.interval = socket_path, timeout, interval
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.latencies.append(timed_status(self.socket_path, self.timeout))
            self._stop.wait(self.interval)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(self.timeout + 5)
        return self.latencies


def tenant_script(user: tuple[int, int], code: str, root: pathlib.Path, groups: tuple[int, ...] = ()) -> list[str]:
    """A Python process that becomes ``user`` once it imported what tenants
    use (the interpreter may live where that user cannot read), with
    supplementary ``groups``, then runs ``code`` (``root``: the checkout)."""
    prelude = (f"import sys; sys.path.insert(0, {str(root)!r})\n"
               "import json, os, resource, socket, time, msgspec, zmq\n"
               "from kvelastic import protocol as p\n"
               "from tests.daemon.hostile import RawEngine, register_message\n"
               f"os.setgroups({list(groups)}); os.setgid({user[1]}); os.setuid({user[0]})\n")
    return [sys.executable, "-c", prelude + code]


def open_lifeline(socket_path: str, engine_id: str, rank: int = -1, token: bytes = b"") -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(p.fd_socket_path(socket_path))
    p.write_hello(sock, engine_id, rank, token)
    return sock


def register_message(engine_id: str, **kw) -> p.RegisterEngine:
    """A RegisterEngine of a worker-less engine with one 2 MiB page per slab."""
    fields = dict(version=p.PROTOCOL_VERSION, engine_id=engine_id, pid=os.getpid(), namespace="hostile",
                  page_size=PAGE, pages_per_worker=1, num_workers=0, blocks_per_slab=4, block_bytes=PAGE // 4)
    fields.update(kw)
    return p.RegisterEngine(**fields)


class RawEngine:
    """An engine spoken by hand: a DEALER and a lifeline, nothing else. Like a
    real engine it picks its secret, shows it in its lifeline's hello and in
    its registration (unless the message names another)."""

    def __init__(self, socket_path: str, engine_id: str, token: bytes | None = None) -> None:
        self.engine_id = engine_id
        self.token = os.urandom(16) if token is None else token
        self.lifeline = open_lifeline(socket_path, engine_id, token=self.token)
        self.sock = dealer(socket_path)
        self._next = 0

    def send(self, msg: p.Msg) -> int:
        self._next += 1
        msg.req_id = self._next
        if isinstance(msg, p.RegisterEngine) and not msg.token:
            msg.token = self.token
        self.sock.send(p.encode(msg))
        return msg.req_id

    def recv(self, timeout: float) -> p.Msg | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return p.decode(self.sock.recv())

    def request(self, msg: p.Msg, timeout: float = 5.0) -> p.Msg:
        req_id = self.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.recv(max(0.0, deadline - time.monotonic()))
            if reply is None:
                raise TimeoutError(f"no answer to {type(msg).__name__} within {timeout} s")
            if reply.req_id == req_id:
                return reply

    def close(self) -> None:
        self.sock.close(0)
        self.lifeline.close()


def slow_hello(socket_path: str, engine_id: str, interval: float, stop: threading.Event) -> threading.Thread:
    """A client that opens a page channel and sends its ``Hello`` one byte every
    ``interval`` seconds until ``stop`` (then closes it). Stops quietly if the
    daemon closes the connection first."""
    import msgspec

    body = msgspec.msgpack.encode(p.Hello(p.PROTOCOL_VERSION, engine_id, 0))
    hello = len(body).to_bytes(4, "little") + body

    def run() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(p.fd_socket_path(socket_path))
            for i in range(len(hello) - 1):       # never the last byte: the hello stays incomplete
                sock.sendall(hello[i:i + 1])
                if stop.wait(interval):
                    return
            stop.wait()
        except OSError:
            return
        finally:
            sock.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def rejected_total(daemon) -> float:
    """Sum of ``kvelastic_rejected_messages_total`` over every reason."""
    total = 0.0
    for line in daemon.metrics().splitlines():
        if line.startswith("kvelastic_rejected_messages_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kv_event_batches(socket_path: str, timeout: float = 5.0) -> list[tuple[bytes, int, KVEventBatch]]:
    """Every KV event batch the daemon still keeps (default endpoints), through
    its replay socket: ``(topic, seq, batch)`` in order."""
    import msgspec

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{socket_path}.kv-events-replay")
    out = []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError("no answer from the KV events replay socket")
            _, topic, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
    finally:
        sock.close(0)


# --------------------------------------------------- the child process itself
def _peek_poke(worker, offset: int, value: int | None) -> int:
    """Write (``value`` not None) then read the first byte of the page at ``offset``."""
    if worker.backend.name == "host":
        import ctypes

        cell = ctypes.c_uint8.from_address(worker.arena.base + offset)
        if value is not None:
            cell.value = value
        return cell.value
    import torch  # the CUDA arena hands out torch tensors

    view = worker.arena.tensor(torch.uint8, (worker.arena.size,))
    if value is not None:
        view[offset] = value
    return int(view[offset])


def _late_to_notice(worker, delay: float) -> None:
    """The worker notices that the daemon went away ``delay`` seconds late (its
    I/O thread busy elsewhere), so whatever the daemon sent before it exited is
    surely read and acted on: what a departing daemon asks of its workers
    shows, instead of racing with their reconnection."""
    conn = worker.conn
    closed = conn._lifeline_closed
    first_seen: list[float] = []

    def late() -> bool:
        if not closed():
            return False
        first_seen[:] = first_seen or [time.monotonic()]
        if time.monotonic() - first_seen[0] < delay:
            time.sleep(0.005)
            return False
        first_seen.clear()
        return True

    conn._lifeline_closed = late


def _keep_mappings(worker) -> None:
    """A hostile worker: it acknowledges every unmap but keeps the mapping
    (``worker.stale``: slab -> arena offsets it still maps)."""
    worker.stale = {}

    def unmap(msg) -> None:
        with worker._mu:
            worker.stale[msg.slab] = worker.slabs.pop(msg.slab, msg.offsets)
        worker.conn.send(p.Unmapped(req_id=msg.req_id, engine_id=worker.engine_id, rank=worker.rank,
                                    slab=msg.slab))

    worker._unmap = unmap


def _view_op(workers, op: str, value: int) -> list[int]:
    values = []
    for worker in workers:
        with worker.step():
            with worker._mu:
                offsets = sorted(o for offs in worker.slabs.values() for o in offs)
            values += [_peek_poke(worker, o, value if op == "write" else None) for o in offsets]
    return values


def _worker_state(workers) -> dict:
    out = {"mapped": 0, "worker_slabs": {}, "base": None}
    for worker in workers:
        with worker._mu:
            out["mapped"] += len(worker.arena.mapped()) if worker.arena is not None else 0
            out["worker_slabs"].update({str(s): list(offs) for s, offs in worker.slabs.items()})
            if worker.arena is not None and out["base"] is None:
                out["base"] = worker.arena.base
    return out


def _main() -> None:  # pragma: no cover - runs in the child
    import logging

    from kvelastic.client.connection import DaemonError, DaemonUnavailable
    from kvelastic.client.engine import EngineClient
    from kvelastic.client.worker import WorkerClient
    from kvelastic.core.pool import SlabPool
    from kvelastic.vmm import get_backend

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = json.loads(sys.argv[1])
    if cfg.get("role") == "worker":
        worker = WorkerClient(get_backend(TEST_BACKEND), socket_path=cfg["socket"], engine_id=cfg["engine_id"],
                              rank=cfg.get("rank", 0), token=bytes.fromhex(cfg.get("token", ""))).start()
        if cfg.get("notice_exit_after"):
            _late_to_notice(worker, cfg["notice_exit_after"])
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            out: dict = {}
            if cmd["op"] in ("write", "read"):
                out["values"] = _view_op([worker], cmd["op"], cmd.get("value", 0))
            out["state"] = _worker_state([worker])
            print(json.dumps(out), flush=True)
        worker.close()
        return

    bps = cfg.get("bps", 4)
    pool = SlabPool(bps)
    num_workers = cfg.get("workers", 1)
    engine = EngineClient(
        pool, socket_path=cfg["socket"], engine_id=cfg["engine_id"], namespace=cfg.get("namespace", "ns"),
        page_size=PAGE, pages_per_worker=1, num_workers=num_workers, block_bytes=PAGE // bps,
        min_bytes=cfg.get("min_bytes", 0), max_bytes=cfg.get("max_bytes", 0),
        low_watermark=cfg.get("low_watermark", 0), keep_idle_slabs=cfg.get("keep_idle", 0),
        shrink_grace=cfg.get("grace", 60.0)).start()
    backend = get_backend(TEST_BACKEND) if num_workers else None
    workers = [WorkerClient(backend, socket_path=cfg["socket"], engine_id=cfg["engine_id"], rank=rank,
                            token=engine.token).start()
               for rank in cfg.get("ranks", range(num_workers))]
    for worker in workers:
        if cfg.get("notice_exit_after"):
            _late_to_notice(worker, cfg["notice_exit_after"])
        if cfg.get("keep_mappings"):
            _keep_mappings(worker)
    live: list = []
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op, out = cmd["op"], {}
        if op == "ensure":
            start = time.monotonic()
            out["ok"] = engine.ensure(cmd["n"], timeout=cmd.get("timeout", 5.0))
            out["elapsed"] = time.monotonic() - start
        elif op == "grow":
            # A raw demand grow on the engine's own connection: what came back, and when.
            start = time.monotonic()
            try:
                reply = engine.conn.call(p.Grow(engine_id=engine.engine_id, slabs=cmd.get("n", 1),
                                                demand=True), cmd.get("timeout", 10.0))
                out["reply"] = {"type": type(reply).__name__, "slabs": list(getattr(reply, "slabs", []))}
                with engine.lock:
                    engine._apply_grant(reply)
            except DaemonError as exc:
                out["reply"] = {"type": "Error", "reason": exc.reason}
            except DaemonUnavailable as exc:
                out["reply"] = {"type": "none", "error": str(exc)}
            out["elapsed"] = time.monotonic() - start
        elif op == "journal":
            # A journal on the engine's own connection (keys as hex; anything else as given).
            ops = [tuple(bytes.fromhex(x[4:]) if isinstance(x, str) and x.startswith("hex:") else x for x in o)
                   for o in cmd["ops"]]
            try:   # as the wire carries them; an op that fits no wire op goes as given (and fails decoding)
                ops = [p.journal_ops([op])[0] if isinstance(op[1] if len(op) > 1 else 0, (bytes, int))
                       and all(isinstance(x, (bytes, int)) for x in op) else op for op in ops]
            except (TypeError, KeyError, IndexError):
                pass
            occupancy = {int(k): tuple(v) for k, v in cmd.get("occupancy", {}).items()}
            msg = p.Journal(engine_id=engine.engine_id, ops=ops, occupancy=occupancy)
            try:
                engine.conn.call(msg, cmd.get("timeout", 2.0))
                out["reply"] = {"type": "other"}
            except DaemonError as exc:
                out["reply"] = {"type": "Error", "reason": exc.reason}
            except DaemonUnavailable:
                out["reply"] = {"type": "none"}
        elif op == "alloc":
            with engine.lock:
                live.extend(pool.allocate(cmd["n"]))
        elif op == "cache":
            with engine.lock:
                pool.cache(live, [f"{cmd['prefix']}-{i}".encode() for i in range(len(live))])
        elif op == "free":
            with engine.lock:
                pool.free(live[::-1])
            live.clear()
        elif op == "read_stale":      # what the pages it kept mapped (acknowledged as unmapped) show now
            out["values"] = [_peek_poke(w, o, None) for w in workers for offs in w.stale.values() for o in offs]
        elif op in ("write", "read"):
            out["values"] = _view_op(workers, op, cmd.get("value", 0))
        with engine.lock:
            out["state"] = {"slabs": sorted(pool.slab_ids()), "free": pool.num_free, "cached": pool.num_cached,
                            "live": pool.num_live, "reconnects": engine.conn.reconnects,
                            "token": engine.token.hex(), **_worker_state(workers)}
        print(json.dumps(out), flush=True)
    engine.close()
    for worker in workers:
        worker.close()


if __name__ == "__main__":
    _main()
