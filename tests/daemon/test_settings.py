"""Every ``KVELASTIC_*`` variable changes what a user can observe.

``config.VARIABLES`` is the list of settings; each has a probe here that runs
the real part that reads it (a daemon, engine and worker processes, the vLLM
plugin) with a value other than the default and checks a difference a user
would see. A variable without a probe fails ``test_every_variable_has_a_probe``:
a setting that nothing reads cannot be documented.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
import zmq

from kvelastic import protocol as p
from kvelastic.config import VARIABLES
from kvelastic.status_report import DeviceStatus, EngineStatus
from tests.daemon.engines import EngineProcess, with_engine_token
from tests.daemon.hostile import Driver, RawEngine, kv_event_batches, register_message, tenant_script
from tests.daemon_proc import DaemonProcess, short_dir, wait_for

MiB = 1 << 20


class Node:
    """Daemons and client processes started by one probe, stopped after it."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.daemons: list[DaemonProcess] = []
        self.peers: list[EngineProcess] = []

    def daemon(self, memory: str = "16MiB", **env: str) -> DaemonProcess:
        """A daemon with the tests' settings (``DaemonProcess``) overridden by ``env``."""
        folder = self.tmp / f"d{len(self.daemons)}"
        folder.mkdir()
        d = DaemonProcess(folder, memory=memory)
        d.env.update(env)
        d.socket = d.env["KVELASTIC_SOCKET"]
        d.metrics_port = int(d.env["KVELASTIC_METRICS_PORT"])
        self.daemons.append(d)
        return d.start()

    def engine(self, daemon: DaemonProcess, engine_id: str, **cfg) -> EngineProcess:
        proc = EngineProcess(daemon.socket, engine_id, **with_engine_token(self.peers, engine_id, cfg))
        self.peers.append(proc)
        return proc

    def driver(self, daemon: DaemonProcess, engine_id: str, **cfg) -> Driver:
        proc = Driver(daemon.socket, engine_id, **with_engine_token(self.peers, engine_id, cfg))
        self.peers.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.peers):
            proc.close()
        for d in self.daemons:
            if d.proc is not None and d.proc.poll() is None:
                d.stop()


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


PROBES: dict[str, Callable[[Node, pytest.FixtureRequest], None]] = {}


def probe(name: str):
    """Register ``fn(node, request)`` as the probe of variable ``name``."""
    def register(fn: Callable[[Node, pytest.FixtureRequest], None]) -> Callable[[Node, pytest.FixtureRequest], None]:
        PROBES[name] = fn
        return fn
    return register


def engine_status(daemon: DaemonProcess, engine_id: str) -> EngineStatus | None:
    return next((e for e in daemon.request(p.Status()).status.engines if e.engine_id == engine_id), None)


def device(daemon: DaemonProcess) -> DeviceStatus:
    return daemon.request(p.Status()).status.devices[0]


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as reply:
        return reply.status


def listening_tcp_ports(pid: int) -> set[int]:
    """TCP ports a process listens on: its socket inodes matched against the
    kernel's table (LISTEN is state 0A)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# ------------------------------------------------------------ the daemon
@probe("KVELASTIC_BACKEND")
def _backend(node: Node, request: pytest.FixtureRequest) -> None:
    assert device(node.daemon(KVELASTIC_BACKEND="host")).backend == "host"
    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if gpu:
        assert device(node.daemon(KVELASTIC_BACKEND="cuda")).backend == "cuda"
    else:   # asking for CUDA VMM where there is none is an error, not a silent fallback
        with pytest.raises(RuntimeError, match="(?i)cuda"):
            node.daemon(KVELASTIC_BACKEND="cuda")


@probe("KVELASTIC_MEMORY")
def _memory(node: Node, request: pytest.FixtureRequest) -> None:
    assert device(node.daemon(memory="48MiB")).budget_bytes == 48 * MiB
    assert device(node.daemon(memory="6MiB")).budget_bytes == 6 * MiB


@probe("KVELASTIC_PAGE_SIZE")
def _page_size(node: Node, request: pytest.FixtureRequest) -> None:
    daemon = node.daemon(KVELASTIC_PAGE_SIZE="4MiB")
    two, four = RawEngine(daemon.socket, "two"), RawEngine(daemon.socket, "four")
    try:   # engines must lay their slabs out in the daemon's pages
        refused = two.request(register_message("two"))
        assert isinstance(refused, p.Error) and refused.reason == "geometry", refused
        ok = four.request(register_message("four", page_size=4 * MiB, block_bytes=MiB))
        assert isinstance(ok, p.Registered), ok
    finally:
        two.close()
        four.close()


@probe("KVELASTIC_SOCKET")
def _socket(node: Node, request: pytest.FixtureRequest) -> None:
    elsewhere = node.tmp / "elsewhere" / "k.sock"
    elsewhere.parent.mkdir()
    daemon = node.daemon(KVELASTIC_SOCKET=str(elsewhere))
    assert elsewhere.is_socket() and isinstance(daemon.request(p.Status()), p.StatusReply)
    assert not (node.tmp / "d0" / "kvelastic.sock").exists()


@probe("KVELASTIC_METRICS_PORT")
def _metrics_port(node: Node, request: pytest.FixtureRequest) -> None:
    on = node.daemon()
    assert on.metrics_port in listening_tcp_ports(on.proc.pid)
    assert get(f"http://127.0.0.1:{on.metrics_port}/metrics") == 200
    off = node.daemon(KVELASTIC_METRICS_PORT="0")
    assert listening_tcp_ports(off.proc.pid) == set()


@probe("KVELASTIC_METRICS_ADDR")
def _metrics_addr(node: Node, request: pytest.FixtureRequest) -> None:
    daemon = node.daemon(KVELASTIC_METRICS_ADDR="127.0.0.2")
    assert get(f"http://127.0.0.2:{daemon.metrics_port}/metrics") == 200
    with pytest.raises(urllib.error.URLError):
        get(f"http://127.0.0.1:{daemon.metrics_port}/metrics")


@probe("KVELASTIC_KV_EVENTS_ENDPOINT")
def _kv_events_endpoint(node: Node, request: pytest.FixtureRequest) -> None:
    events = node.tmp / "events.ipc"
    daemon = node.daemon(KVELASTIC_KV_EVENTS_ENDPOINT=f"ipc://{events}")
    assert events.is_socket() and not pathlib.Path(daemon.socket + ".kv-events").exists()
    assert pathlib.Path(f"{events}-replay").is_socket()       # the replay socket follows it
    off = node.daemon(KVELASTIC_KV_EVENTS_ENDPOINT="off")
    assert not pathlib.Path(off.socket + ".kv-events").exists()
    assert not pathlib.Path(off.socket + ".kv-events-replay").exists()


@probe("KVELASTIC_KV_EVENTS_REPLAY_ENDPOINT")
def _kv_events_replay_endpoint(node: Node, request: pytest.FixtureRequest) -> None:
    replay = node.tmp / "replay.ipc"
    daemon = node.daemon(KVELASTIC_KV_EVENTS_REPLAY_ENDPOINT=f"ipc://{replay}")
    assert replay.is_socket() and not pathlib.Path(daemon.socket + ".kv-events-replay").exists()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{replay}")
    try:   # it answers vLLM's replay protocol: an empty history ends with sequence -1
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        assert sock.poll(5000), "no answer on the replay endpoint"
        assert int.from_bytes(sock.recv_multipart()[2], "big", signed=True) == -1
    finally:
        sock.close(0)


@probe("KVELASTIC_KV_EVENTS_BUFFER")
def _kv_events_buffer(node: Node, request: pytest.FixtureRequest) -> None:
    def batches_kept(buffer: str | None) -> int:
        daemon = node.daemon(**({"KVELASTIC_KV_EVENTS_BUFFER": buffer} if buffer else {}))
        e = node.engine(daemon, f"events-{buffer}", grace=60)
        assert e.do("ensure", n=4)["ok"]
        for i in range(4):     # four journals, one batch of events each
            e.do("alloc", n=1)
            e.do("cache", prefix=f"p{i}")
            e.do("free")
            wait_for(lambda i=i: engine_status(daemon, e.engine_id).cached_blocks == i + 1, what="the journal")
        return len(kv_event_batches(daemon.socket))

    assert batches_kept(None) >= 4
    assert batches_kept("2") == 2


@probe("KVELASTIC_SOCKET_GROUP")
def _socket_group(node: Node, request: pytest.FixtureRequest) -> None:
    others = [g for g in os.getgroups() if g != os.getegid()]
    group = 4242 if os.geteuid() == 0 else (others[0] if others else None)
    if group is None:
        pytest.skip("needs root or a supplementary group to hand the sockets to")
    daemon = node.daemon(KVELASTIC_SOCKET_GROUP=str(group))
    for path in (daemon.socket, p.fd_socket_path(daemon.socket)):
        assert os.stat(path).st_gid == group
    assert os.stat(node.daemon().socket).st_gid == os.getegid()


@probe("KVELASTIC_OPERATOR_GROUP")
def _operator_group(node: Node, request: pytest.FixtureRequest) -> None:
    """A tenant in the operator group may set limits; one outside it may not."""
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to run a tenant of another uid")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvelastic-operators-"))
    folder.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    daemon = DaemonProcess(folder, KVELASTIC_SOCKET_GROUP="4242", KVELASTIC_OPERATOR_GROUP="4243").start()
    node.daemons.append(daemon)
    root = pathlib.Path(__file__).resolve().parents[2]
    ask = f"""
e = RawEngine({daemon.socket!r}, "asker")
print(e.request(p.SetLimit(engine_id="nobody", min_bytes=0, max_bytes=0)).reason)
e.close()
"""
    for groups, reason in (((4243,), "unknown_engine"), ((), "not_operator")):
        out = subprocess.run(tenant_script((6003, 4242), ask, root, groups), capture_output=True, text=True,
                             timeout=60, cwd=root)
        assert out.stdout.strip() == reason, (groups, out.stdout + out.stderr)


@probe("KVELASTIC_MAX_ENGINES")
def _max_engines(node: Node, request: pytest.FixtureRequest) -> None:
    daemon = node.daemon(KVELASTIC_MAX_ENGINES="1")
    first, second = RawEngine(daemon.socket, "first"), RawEngine(daemon.socket, "second")
    try:
        assert isinstance(first.request(register_message("first")), p.Registered)
        refused = second.request(register_message("second"))
        assert isinstance(refused, p.Error) and refused.reason == "limit", refused
    finally:
        first.close()
        second.close()


def _grow_with_a_stopped_worker(node: Node, **env: str) -> tuple[DaemonProcess, Driver, float]:
    """An engine whose only worker is stopped (SIGSTOP) asks to grow: the
    daemon waits for a map acknowledgement that does not come."""
    daemon = node.daemon(**env)
    engine = node.driver(daemon, "a", ranks=[])
    worker = node.driver(daemon, "a", role="worker")
    wait_for(lambda: getattr(engine_status(daemon, "a"), "workers", 0) == 1, timeout=10, what="the worker")
    worker.freeze()
    engine.send("grow", n=1, timeout=30)
    return daemon, engine, time.monotonic()


@probe("KVELASTIC_GROW_TIMEOUT")
def _grow_timeout(node: Node, request: pytest.FixtureRequest) -> None:
    _, engine, started = _grow_with_a_stopped_worker(node, KVELASTIC_GROW_TIMEOUT="0.5s",
                                                     KVELASTIC_ACK_TIMEOUT="30s")
    grow = engine.recv(timeout=10)
    assert grow["reply"] == {"type": "Granted", "slabs": []}, grow   # answered with what was mapped: nothing
    assert 0.4 <= grow["elapsed"] < 2.5, grow                         # the default would be 5 s


@probe("KVELASTIC_ACK_TIMEOUT")
def _ack_timeout(node: Node, request: pytest.FixtureRequest) -> None:
    daemon, _, started = _grow_with_a_stopped_worker(node, KVELASTIC_ACK_TIMEOUT="0.5s",
                                                     KVELASTIC_GROW_TIMEOUT="30s")
    wait_for(lambda: device(daemon).pages.quarantined >= 1, timeout=3,   # the default would be 5 s
             what="the engine failed and its page quarantined")
    assert time.monotonic() - started < 3


@probe("KVELASTIC_IDLE_GRACE")
def _idle_grace(node: Node, request: pytest.FixtureRequest) -> None:
    daemon = node.daemon(KVELASTIC_IDLE_GRACE="0.3s")
    e = node.engine(daemon, "quiet", grace=60)
    assert e.do("ensure", n=4)["ok"]
    started = time.monotonic()
    wait_for(lambda: engine_status(daemon, "quiet").idle, timeout=2, what="idle")   # the default would be 5 s
    assert time.monotonic() - started < 2


@probe("KVELASTIC_HOLD_DOWN")
def _hold_down(node: Node, request: pytest.FixtureRequest) -> None:
    def moved_back(hold: str, wait: float) -> bool:
        """b takes a's cache (hard demand); at once a wants it back (hard too),
        waiting at most ``wait`` seconds (generous where the answer is yes: a
        loaded machine is slow, never wrong)."""
        daemon = node.daemon(memory="4MiB", KVELASTIC_IDLE_GRACE="30s", KVELASTIC_HOLD_DOWN=hold)  # two slabs
        a, b = node.engine(daemon, f"a{hold}", grace=60), node.engine(daemon, f"b{hold}", grace=60)
        for e in (a, b):
            assert e.do("ensure", n=8, keep_cache=True, timeout=10)["ok"]
            e.do("alloc", n=8)
            e.do("cache", prefix=e.engine_id)
            e.do("free")
        # The daemon must know b's blocks are cached, not live (b's journal), or no slab is a candidate.
        wait_for(lambda: any(e["engine_id"] == b.engine_id and e["cached_blocks"] == 8 and e["live_blocks"] == 0
                             for e in daemon.status()["engines"]), timeout=30, what="b's cache in the daemon's books")
        return a.do("ensure", n=4, keep_cache=True, timeout=wait)["ok"]

    assert moved_back("0s", wait=30)
    assert not moved_back("30s", wait=2)     # 30 s of hold-down: not within 2 s


@probe("KVELASTIC_ORPHAN_CACHE_TTL")
def _orphan_cache_ttl(node: Node, request: pytest.FixtureRequest) -> None:
    def kept_after_exit(ttl: str) -> DaemonProcess:
        """An engine caches 4 blocks in a finished step and is killed."""
        daemon = node.daemon(memory="4MiB", KVELASTIC_ORPHAN_CACHE_TTL=ttl)
        e = node.engine(daemon, f"e{ttl}", namespace="ns", grace=60)
        assert e.do("ensure", n=4)["ok"]
        step = e.do("step")["step"]
        e.do("alloc", n=4)
        e.do("cache", prefix="sys")
        e.do("end_step", n=step)
        e.do("free")
        e.do("flush")
        e.kill()
        wait_for(lambda: not daemon.request(p.Status()).status.engines, what="the engine gone")
        return daemon

    kept = kept_after_exit("10m")
    wait_for(lambda: device(kept).memory.orphaned == 2 * MiB, what="its cache kept for the namespace")
    dropped = kept_after_exit("0")
    wait_for(lambda: device(dropped).memory.held == 0, what="its memory back")
    assert device(dropped).memory.orphaned == 0 and not dropped.request(p.Status()).status.orphans


@probe("KVELASTIC_LOG_LEVEL")
def _log_level(node: Node, request: pytest.FixtureRequest) -> None:
    assert " INFO " in node.daemon().log()
    quiet = node.daemon(KVELASTIC_LOG_LEVEL="error")
    quiet.request(p.Status())
    assert " INFO " not in quiet.log() and " WARNING " not in quiet.log()


@probe("KVELASTIC_TIER_DIR")
def _tier_dir(node: Node, request: pytest.FixtureRequest) -> None:
    from kvelastic.daemon.main import load_hash_secret
    from kvelastic.tier.disk import DiskStore

    assert node.daemon().request(p.Status()).status.tier is None        # no tier by default
    folder = short_dir(node.tmp) / "tier"
    former = node.daemon(KVELASTIC_TIER_DIR=str(folder))                 # its key, beside its socket, keys its blocks
    former.stop()
    DiskStore(folder, key=load_hash_secret(former.socket)).write(0, "ns", b"key", b"kv" * 100, cost=1.0)
    tier = former.start().request(p.Status()).status.tier
    assert tier is not None and tier.namespaces == {"ns": 1} and tier.bytes == 200


@probe("KVELASTIC_TIER_SIZE")
def _tier_size(node: Node, request: pytest.FixtureRequest) -> None:
    folder = short_dir(node.tmp) / "tier"
    tier = node.daemon(KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="3MiB").request(p.Status()).status.tier
    assert tier is not None and tier.budget_bytes == 3 << 20


@probe("KVELASTIC_TIER_HOST_SIZE")
def _tier_host_size(node: Node, request: pytest.FixtureRequest) -> None:
    tier = node.daemon(KVELASTIC_TIER_HOST_SIZE="3MiB").request(p.Status()).status.tier
    assert tier is not None and (tier.medium, tier.budget_bytes, tier.blocks) == ("host", 3 << 20, 0)
    both = node.daemon(KVELASTIC_TIER_HOST_SIZE="3MiB", KVELASTIC_TIER_DIR=str(short_dir(node.tmp) / "tier"),
                       KVELASTIC_TIER_SIZE="5MiB").request(p.Status()).status.tier      # host memory above the disk
    assert both is not None and both.medium == "host+disk" and both.budget_bytes == 8 << 20
    assert [(m.medium, m.budget_bytes) for m in both.levels] == [("host", 3 << 20), ("disk", 5 << 20)]


# The tier stream's settings: the probes live beside its tests (tests/tier/test_tier_stream_tcp.py).
@probe("KVELASTIC_TIER_EVENTS_ENDPOINT")
@probe("KVELASTIC_TIER_EVENTS_REPLAY_ENDPOINT")
def _tier_events_endpoints(node: Node, request: pytest.FixtureRequest) -> None:
    from tests.tier.test_tier_stream_tcp import probe_endpoints
    probe_endpoints(node.daemon, node.tmp)


@probe("KVELASTIC_TIER_EVENTS_TOKEN_IDS")
def _tier_events_token_ids(node: Node, request: pytest.FixtureRequest) -> None:
    from tests.tier.test_tier_stream_tcp import probe_token_ids
    probe_token_ids(node.tmp)


@probe("KVELASTIC_TIER_EVENTS_CURVE_CERT")
@probe("KVELASTIC_TIER_EVENTS_CURVE_CLIENTS")
def _tier_events_curve(node: Node, request: pytest.FixtureRequest) -> None:
    from tests.tier.test_tier_stream_tcp import probe_curve
    probe_curve(node.daemon, node.tmp)


# ------------------------------------------------------ the vLLM plugin
# Two real vLLM runs through the plugin: ``plugin_runs`` in tests/conftest.py.
@probe("KVELASTIC_ENABLE")
def _enable(node: Node, request: pytest.FixtureRequest) -> None:
    pytest.importorskip("vllm")
    from tests.vllm import zygote

    script = ("import kvelastic_vllm, vllm.v1.core.kv_cache_coordinator as c; kvelastic_vllm.register(); "
              "print(c.BlockPool.__name__)")
    def block_pool(enable: str) -> str:
        out = zygote.run([sys.executable, "-c", script], env={**os.environ, "KVELASTIC_ENABLE": enable},
                         timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.split()[-1]

    assert block_pool("0") == "BlockPool"            # stock vLLM: the plugin is inert
    assert block_pool("1") == "ElasticBlockPool"


@probe("KVELASTIC_ENGINE_ID")
def _engine_id(node: Node, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("plugin_runs")
    assert runs["tuned"]["engine"]["engine_id"] == "tuned-engine"
    assert runs["plain"]["engine"]["engine_id"] == f"{socket.gethostname()}-{runs['plain']['engine']['pid']}"


@probe("KVELASTIC_ENGINE_MIN_MEMORY")
def _engine_min_memory(node: Node, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("plugin_runs")
    assert (runs["plain"]["engine"]["min_bytes"], runs["tuned"]["engine"]["min_bytes"]) == (0, 4 * MiB)


@probe("KVELASTIC_ENGINE_MAX_MEMORY")
def _engine_max_memory(node: Node, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("plugin_runs")
    assert runs["tuned"]["engine"]["max_bytes"] == 40 * MiB and runs["plain"]["engine"]["max_bytes"] != 40 * MiB


@probe("KVELASTIC_TENANT_SALT")
def _tenant_salt(node: Node, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("plugin_runs")   # same model and geometry: only the salt differs
    assert runs["plain"]["engine"]["namespace"].startswith("tiny-llama-")
    assert runs["tuned"]["engine"]["namespace"].startswith("tiny-llama-")
    assert runs["plain"]["engine"]["namespace"] != runs["tuned"]["engine"]["namespace"]


@probe("KVELASTIC_PRIVATE_CACHE")
def _private_cache(node: Node, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("plugin_runs")   # the tuned engine's cache is its own, in a namespace of its own
    plain, tuned = runs["plain"]["engine"], runs["tuned"]["engine"]
    assert tuned["private"] and "~" in tuned["namespace"]
    assert not plain["private"] and "~" not in plain["namespace"]


@probe("KVELASTIC_WORKER_DEVICES")
def _worker_devices(node: Node, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("plugin_runs")   # a daemon of two host devices: the tuned worker on "1"
    assert runs["tuned"]["engine"]["worker_devices"] == {"0": "1"}
    assert runs["plain"]["engine"]["worker_devices"] == {"0": "0"}


@probe("KVELASTIC_HOST_DEVICES")
def _host_devices(node: Node, request: pytest.FixtureRequest) -> None:
    devices = node.daemon(memory="32MiB", KVELASTIC_HOST_DEVICES="2").request(p.Status()).status.devices
    assert [(d.device, d.budget_bytes) for d in devices] == [("0", 16 * MiB), ("1", 16 * MiB)]
    assert [d.device for d in node.daemon(memory="32MiB").request(p.Status()).status.devices] == ["0"]


@probe("KVELASTIC_PREFIX_CACHE_MAX_SIZE")
def _prefix_cache_max_size(node: Node, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("plugin_runs")
    plain = runs["plain"]["engine"]
    assert plain["stats"]["evictions_size_limit"] > 0 and plain["cached_blocks"] == 0
    assert runs["tuned"]["engine"]["stats"]["evictions_size_limit"] == 0


def started_keeper_pid(daemon: DaemonProcess) -> int | None:
    found = [line for line in daemon.log().splitlines() if "started a keeper (pid " in line]
    return int(found[-1].split("(pid ")[1].split(")")[0]) if found else None


@probe("KVELASTIC_KEEPER")
def _keeper(node: Node, request: pytest.FixtureRequest) -> None:
    off = node.daemon(KVELASTIC_KEEPER="off")
    assert started_keeper_pid(off) is None and not os.path.exists(p.keeper_socket_path(off.socket))
    auto = node.daemon(KVELASTIC_KEEPER="auto")
    pid = started_keeper_pid(auto)
    assert pid is not None and os.path.exists(p.keeper_socket_path(auto.socket))
    os.kill(pid, 15)
    # external: tests/daemon/test_started_keeper.py, and every test of test_keeper_daemon.py


@probe("KVELASTIC_KEEPER_LINGER")
def _keeper_linger(node: Node, request: pytest.FixtureRequest) -> None:
    daemon = node.daemon(KVELASTIC_KEEPER="auto", KVELASTIC_KEEPER_LINGER="0.5s")
    path = p.keeper_socket_path(daemon.socket)
    daemon.stop()
    wait_for(lambda: not os.path.exists(path), timeout=30, what="the keeper gone 0.5 s after its daemon")
    with open(path + ".log") as f:
        assert "stopping (no daemon for 0.5 s)" in f.read()


@probe("KVELASTIC_PREFIX_CACHE_TTL")
def _prefix_cache_ttl(node: Node, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("plugin_runs")
    assert runs["tuned"]["engine"]["stats"]["evictions_ttl"] > 0 and runs["tuned"]["engine"]["cached_blocks"] == 0
    assert runs["plain"]["engine"]["stats"]["evictions_ttl"] == 0


# ------------------------------------------------------------------ tests
def test_every_variable_has_a_probe():
    assert set(PROBES) == {v.name for v in VARIABLES}


@pytest.mark.parametrize("name", sorted(PROBES))
def test_a_setting_changes_what_a_user_sees(name, node, request):
    PROBES[name](node, request)
