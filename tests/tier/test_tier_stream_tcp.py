"""The tier stream stays off TCP unless it cannot leak: real daemon processes.

Its events carry every tenant's token ids (the engines' own labels). On
``ipc://`` only the daemon's user may connect (``test_tier_events.py``); TCP
checks no one, so (1) a daemon whose node stream is on TCP publishes no tier
stream there unless asked to; (2) asked to without token ids, a reader of
another uid gets hashes and parents only; (3) under CURVE only the allowed
client key completes a handshake, and gets the token ids; (4) a TCP tier
endpoint with neither is refused at start, with the two ways out.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import time

import msgspec
import pytest
import zmq
import zmq.auth

from kvelastic.daemon.events import END_SEQ
from kvelastic.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from tests.daemon.hostile import tenant_script
from tests.daemon_proc import DaemonProcess, free_port, short_dir
from tests.tier.labelled_peer import published, tokens
from tests.tier.test_tier_events import TOPIC, demoted, keys

pytestmark = pytest.mark.skipif(__import__("tests.backend").backend.TEST_BACKEND != "host",
                                reason="demotion source A reads memfd pages: host backend")
ROOT = pathlib.Path(__file__).resolve().parents[2]
MALLORY = (6002, 6002)              # a tenant uid (tests/daemon/test_tenants.py)
WINDOW = 3.0                         # what must not arrive is watched this long, after a positive control
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


# ------------------------------------------------------------------ helpers
def tcp_ports(n: int) -> list[int]:
    """``n`` consecutive free ports (a node stream's port and the ones the
    tier stream took beside it before)."""
    for _ in range(100):
        first = free_port()
        if all(not listening(first + i) and _bindable(first + i) for i in range(n)):
            return [first + i for i in range(n)]
    raise RuntimeError("no run of free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def listening(port: int) -> bool:
    """Something on 127.0.0.1 accepts TCP connections on ``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def curve(sock: zmq.Socket, server_key: bytes, keypair: tuple[bytes, bytes]) -> zmq.Socket:
    """``sock`` as a CURVE client of the server ``server_key``, with ``keypair``."""
    sock.curve_serverkey = server_key
    sock.curve_publickey, sock.curve_secretkey = keypair
    return sock


def subscribed(endpoint: str, secure=None) -> zmq.Socket:
    """A SUB to every topic of ``endpoint``, returned once its handshake is done
    (so it hears what is published from now on); ``secure(sock)``: CURVE."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    if secure is not None:
        secure(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        assert monitor.poll(10_000), f"no handshake with {endpoint}"
    finally:
        sock.disable_monitor()
        monitor.close(0)
    return sock


def stored_events(sock: zmq.Socket, n: int, timeout: float = 20.0) -> list[BlockStored]:
    """The first ``n`` ``BlockStored`` of the tier's topic that ``sock`` receives."""
    out: list[BlockStored] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"{len(out)} of {n} stored events"
        topic, _, payload = sock.recv_multipart()
        if topic == TOPIC:
            out.extend(e for e in _decoder.decode(payload).events if isinstance(e, BlockStored))
    return out


def replayed(endpoint: str, secure=None, timeout: float = 5.0) -> list[tuple[bytes, KVEventBatch]] | None:
    """Every batch the stream kept, through its replay socket; None when it
    does not answer within ``timeout``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secure is not None:
        secure(sock)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            if not sock.poll(int(timeout * 1000)):
                assert not out, "a replay stopped halfway"
                return None
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic, _decoder.decode(payload)))
    finally:
        sock.close(0)


def the_labels(events: list[BlockStored]) -> None:
    """``events`` are the four demoted blocks as the engine labelled them: hashes, parents, token ids."""
    want = [published(k) for k in keys("sys", 4)]
    assert [e.block_hashes[0] for e in events] == want
    assert [e.parent_block_hash for e in events] == [None, *want[:-1]]
    assert [t for e in events for t in e.token_ids] == tokens("sys", 4)


def hashes_only(events: list[BlockStored]) -> None:
    """The same blocks, their hashes and parents alone."""
    want = [published(k) for k in keys("sys", 4)]
    assert [e.block_hashes[0] for e in events] == want
    assert [e.parent_block_hash for e in events] == [None, *want[:-1]]
    assert all(e.token_ids == [] and e.lora_id is None and e.lora_name is None and e.extra_keys is None
               and e.medium == "STORAGE" for e in events), events


def tcp_streams(tier: bool = True) -> tuple[dict[str, str], dict[str, str]]:
    """Settings with the node stream on 127.0.0.1 TCP (and the tier stream,
    ``tier``), and the endpoints by name (``node``, ``tier``, ``tier_replay``
    where the tier stream is, or was before it stayed off TCP: port + 2, + 3)."""
    port = tcp_ports(4)[0]
    at = {name: f"tcp://127.0.0.1:{port + i}" for i, name in enumerate(("node", "node_replay", "tier", "tier_replay"))}
    env = {"KVELASTIC_KV_EVENTS_ENDPOINT": at["node"]}
    if tier:
        env.update(KVELASTIC_TIER_EVENTS_ENDPOINT=at["tier"], KVELASTIC_TIER_EVENTS_REPLAY_ENDPOINT=at["tier_replay"])
    return env, at


def curve_keys(folder: pathlib.Path) -> tuple[str, bytes]:
    """The tier stream's server certificate (mode 0600) and its public key."""
    folder.mkdir(mode=0o700, exist_ok=True)
    public, secret = zmq.auth.create_certificates(folder, "tier")
    os.chmod(secret, 0o600)
    return secret, zmq.auth.load_certificate(public)[0]


def as_tenant(user: tuple[int, int], code: str, **kw) -> subprocess.Popen:
    """``code`` in a process of ``user`` (stdin and stdout piped, text)."""
    return subprocess.Popen(tenant_script(user, code, ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, **kw)


# -------------------------------------------------------------------- tests
def test_a_tcp_node_stream_leaves_the_tier_stream_off(tmp_path):
    """Nothing else set: the node stream on TCP, the tier stream on no port
    (before, it took the node's port + 2); the daemon's log says why and how.
    Nothing listens there at all, which no uid gets past, so the subscriber
    here is the test's own (root)."""
    env, at = tcp_streams(tier=False)
    node_sub: list[zmq.Socket] = []
    old_port = int(at["tier"].rsplit(":", 1)[1])

    def subscribe(_ipc: str) -> None:
        node_sub.append(subscribed(at["node"]))
        sub = zmq.Context.instance().socket(zmq.SUB)     # where the tier stream was: no handshake to wait for
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(at["tier"])
        node_sub.append(sub)

    daemon = demoted(tmp_path, subscribe, **env)
    try:
        node, old = node_sub
        # The positive control: the node stream carries the tier's four blocks (keys, no token ids).
        on_node = stored_events(node, 4)
        assert [e.block_hashes[0] for e in on_node] == [k[:-4] for k in keys("sys", 4)]
        assert all(not e.token_ids for e in on_node)
        assert not old.poll(int(WINDOW * 1000)), "something published where the tier stream was"
        assert not listening(old_port) and not listening(old_port + 1)
        assert not pathlib.Path(f"{daemon.socket}.kv-tier").exists()
        log = daemon.log()
        assert f"tier KV events off: the node stream is on {at['node']}" in log, log
        assert "KVELASTIC_TIER_EVENTS_TOKEN_IDS=0" in log and "KVELASTIC_TIER_EVENTS_CURVE_CERT" in log
    finally:
        for sock in node_sub:
            sock.close(0)
        daemon.stop()


# The reader of another uid: subscribes to the tier stream over TCP, says so
# once its handshake is done, then prints (as hex) the batches it heard until
# it has four stored blocks, and those a replay gives it.
READER = """
ctx = zmq.Context.instance()
sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.LINGER, 0); sub.setsockopt(zmq.SUBSCRIBE, b'')
mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
sub.connect({tier!r})
assert mon.poll(10000), 'no handshake'
print('connected', flush=True)
stored, live = 0, []
deadline = time.monotonic() + 60
while stored < 4 and sub.poll(max(1, int((deadline - time.monotonic()) * 1000))):
    topic, _, payload = sub.recv_multipart()
    live.append(payload.hex())
    stored += sum(e.get('type') == 'BlockStored' for e in msgspec.msgpack.decode(payload)[1])
dealer = ctx.socket(zmq.DEALER); dealer.setsockopt(zmq.LINGER, 0); dealer.connect({replay!r})
dealer.send_multipart([b'', bytes(8)])
replay = []
while dealer.poll(10000):
    _, topic, seq, payload = dealer.recv_multipart()
    if not payload:
        break
    replay.append(payload.hex())
print(json.dumps({{'live': live, 'replay': replay}}), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_without_token_ids_another_tenant_reads_hashes_only(tmp_path):
    env, at = tcp_streams()
    reader: list[subprocess.Popen] = []

    def start_reader(_ipc: str) -> None:
        reader.append(as_tenant(MALLORY, READER.format(tier=at["tier"], replay=at["tier_replay"])))
        assert reader[0].stdout.readline().strip() == "connected", reader[0].stderr.read()

    daemon = demoted(tmp_path, start_reader, KVELASTIC_TIER_EVENTS_TOKEN_IDS="0", **env)
    try:
        out, err = reader[0].communicate(timeout=60)
        assert reader[0].returncode == 0, err
        heard = json.loads(out)
        live = [e for p in heard["live"] for e in _decoder.decode(bytes.fromhex(p)).events]
        hashes_only([e for e in live if isinstance(e, BlockStored)])
        kept = [e for p in heard["replay"] for e in _decoder.decode(bytes.fromhex(p)).events]
        assert isinstance(kept[0], AllBlocksCleared)
        hashes_only([e for e in kept if isinstance(e, BlockStored)])
        assert "without token ids" in daemon.log()
    finally:
        for proc in reader:
            proc.kill()
        daemon.stop()


# A subscriber of another uid with a key of its own (the server's public key
# it may know: it is public) and one without CURVE: each counts what it hears
# until told to stop, then asks for a replay with the same key.
INTRUDER = """
ctx = zmq.Context.instance()
def sock(kind, keyed):
    s = ctx.socket(kind); s.setsockopt(zmq.LINGER, 0)
    if keyed:
        s.curve_serverkey = {server!r}; s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    return s
subs = [sock(zmq.SUB, True), sock(zmq.SUB, False)]
for s in subs:
    s.setsockopt(zmq.SUBSCRIBE, b''); s.connect({tier!r})
poller = zmq.Poller()
for s in subs:
    poller.register(s, zmq.POLLIN)
poller.register(sys.stdin, zmq.POLLIN)
print('ready', flush=True)
heard = [0, 0]
while True:
    ready = dict(poller.poll())
    if sys.stdin.fileno() in ready or sys.stdin in ready:
        break
    for i, s in enumerate(subs):
        if s in ready:
            s.recv_multipart(); heard[i] += 1
answered = []
for keyed in (True, False):
    d = sock(zmq.DEALER, keyed); d.connect({replay!r}); d.send_multipart([b'', bytes(8)])
    answered.append(bool(d.poll({window_ms})))
print(json.dumps({{'heard': heard, 'answered': answered}}), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_under_curve_only_the_allowed_key_reads_the_tier_stream(tmp_path):
    """The allowed key (the router's) gets the labels, token ids included, live
    and by replay; another uid's subscribers, with a key of their own or
    without CURVE, hear nothing and get no replay, watched over the whole
    demotion and a window after the allowed one's replay."""
    env, at = tcp_streams()
    cert, server = curve_keys(short_dir(tmp_path) / "curve")
    router = zmq.curve_keypair()
    env.update(KVELASTIC_TIER_EVENTS_CURVE_CERT=cert, KVELASTIC_TIER_EVENTS_CURVE_CLIENTS=router[0].decode())
    allowed: list[zmq.Socket] = []
    intruder: list[subprocess.Popen] = []

    def secure(sock: zmq.Socket) -> zmq.Socket:
        return curve(sock, server, router)

    def subscribe(_ipc: str) -> None:
        intruder.append(as_tenant(MALLORY, INTRUDER.format(server=server, tier=at["tier"], replay=at["tier_replay"],
                                                           window_ms=int(WINDOW * 1000))))
        assert intruder[0].stdout.readline().strip() == "ready", intruder[0].stderr.read()
        allowed.append(subscribed(at["tier"], secure))

    daemon = demoted(tmp_path, subscribe, **env)
    try:
        the_labels(stored_events(allowed[0], 4))
        kept = replayed(at["tier_replay"], secure)
        assert kept is not None and isinstance(kept[0][1].events[0], AllBlocksCleared)
        the_labels([e for topic, batch in kept if topic == TOPIC for e in batch.events if isinstance(e, BlockStored)])
        out, err = intruder[0].communicate("stop\n", timeout=60)
        assert intruder[0].returncode == 0, err
        assert json.loads(out) == {"heard": [0, 0], "answered": [False, False]}
        assert replayed(at["tier_replay"], timeout=WINDOW) is None         # nor root without the key
        log = daemon.log()
        assert "CURVE, 1 client key(s)" in log and "CURVE client key" in log and "refused" in log, log
    finally:
        for sock in allowed:
            sock.close(0)
        for proc in intruder:
            proc.kill()
        daemon.stop()


def test_a_tcp_tier_endpoint_with_neither_is_refused_at_start(tmp_path):
    env, _ = tcp_streams()
    folder = short_dir(tmp_path) / "tier"
    folder.mkdir(mode=0o700)
    daemon = DaemonProcess(tmp_path, KVELASTIC_TIER_DIR=str(folder), **env)
    with pytest.raises(RuntimeError, match="daemon exited with 1"):
        daemon.start()
    log = daemon.log()
    assert "is not ipc:// and its events carry every tenant's token ids" in log, log
    assert "KVELASTIC_TIER_EVENTS_CURVE_CERT" in log and "KVELASTIC_TIER_EVENTS_TOKEN_IDS=0" in log
    # Its replay socket alone on TCP (the PUB beside an ipc node stream) is refused the same way.
    other = tmp_path / "b"
    other.mkdir()
    replay_only = DaemonProcess(other, KVELASTIC_TIER_DIR=str(folder),
                                KVELASTIC_TIER_EVENTS_REPLAY_ENDPOINT=env["KVELASTIC_TIER_EVENTS_REPLAY_ENDPOINT"])
    with pytest.raises(RuntimeError, match="is not ipc://"):
        replay_only.start()


def test_a_curve_certificate_others_can_read_is_refused(tmp_path):
    env, _ = tcp_streams()
    cert, _ = curve_keys(short_dir(tmp_path) / "curve")
    os.chmod(cert, 0o644)
    client = zmq.curve_keypair()[0].decode()
    daemon = DaemonProcess(tmp_path, KVELASTIC_TIER_EVENTS_CURVE_CERT=cert, KVELASTIC_TIER_EVENTS_CURVE_CLIENTS=client,
                           **env)
    with pytest.raises(RuntimeError, match="readable by no one else"):
        daemon.start()


def test_the_tier_streams_endpoints_and_their_checks():
    """Where the configuration puts the tier stream, and what ``tier_stream`` refuses (no daemon)."""
    from kvelastic.config import Config
    from kvelastic.daemon.events import tier_stream
    from kvelastic.errors import ConfigError

    def at(**env: str) -> tuple[str, str]:
        config = Config.from_env({"KVELASTIC_SOCKET": "/run/k.sock", **env})
        return config.tier_events_endpoint, config.tier_events_replay_endpoint

    assert at() == ("ipc:///run/k.sock.kv-tier", "ipc:///run/k.sock.kv-tier-replay")     # as before
    assert at(KVELASTIC_KV_EVENTS_ENDPOINT="tcp://*:5600") == ("", "")                   # off TCP
    assert at(KVELASTIC_KV_EVENTS_ENDPOINT="off") == ("", "")
    assert at(KVELASTIC_TIER_EVENTS_ENDPOINT="off") == ("", "")
    assert at(KVELASTIC_TIER_EVENTS_ENDPOINT="tcp://*:7000") == ("tcp://*:7000", "tcp://*:7001")
    with pytest.raises(ConfigError, match="KVELASTIC_TIER_EVENTS_CURVE_CLIENTS"):
        Config.from_env({"KVELASTIC_TIER_EVENTS_CURVE_CLIENTS": "not-a-key"})
    key = zmq.curve_keypair()[0].decode()
    with pytest.raises(ConfigError, match="needs KVELASTIC_TIER_EVENTS_CURVE_CERT"):
        tier_stream(Config.from_env({"KVELASTIC_TIER_EVENTS_CURVE_CLIENTS": key}))
    stripped = tier_stream(Config.from_env({"KVELASTIC_TIER_EVENTS_ENDPOINT": "tcp://*:7000",
                                            "KVELASTIC_TIER_EVENTS_TOKEN_IDS": "0"}))
    assert stripped.endpoint == "tcp://*:7000" and not stripped.token_ids and stripped.curve is None


# ------------------------------------------------- probes (test_settings.py)
def tier_folder(tmp: pathlib.Path) -> str:
    folder = short_dir(tmp) / "tier"
    folder.mkdir(mode=0o700, exist_ok=True)
    return str(folder)


def probe_curve(start, tmp: pathlib.Path) -> None:
    """``KVELASTIC_TIER_EVENTS_CURVE_*``: with CURVE, the tier's replay socket
    answers the allowed key alone (``start(**env)``: a daemon)."""
    env, at = tcp_streams()
    cert, server = curve_keys(tmp / "curve")
    allowed, other = zmq.curve_keypair(), zmq.curve_keypair()
    start(KVELASTIC_TIER_DIR=tier_folder(tmp), KVELASTIC_TIER_EVENTS_CURVE_CERT=cert,
          KVELASTIC_TIER_EVENTS_CURVE_CLIENTS=allowed[0].decode(), **env)
    kept = replayed(at["tier_replay"], lambda s: curve(s, server, allowed))
    assert kept is not None and isinstance(kept[0][1].events[0], AllBlocksCleared)
    assert replayed(at["tier_replay"], lambda s: curve(s, server, other), timeout=WINDOW) is None


def probe_endpoints(start, tmp: pathlib.Path) -> None:
    """``KVELASTIC_TIER_EVENTS_(REPLAY_)ENDPOINT``: the tier stream where they say, not beside the node's."""
    pub, replay = tmp / "tier.pub", tmp / "tier.replay"
    daemon = start(KVELASTIC_TIER_DIR=tier_folder(tmp), KVELASTIC_TIER_EVENTS_ENDPOINT=f"ipc://{pub}",
                   KVELASTIC_TIER_EVENTS_REPLAY_ENDPOINT=f"ipc://{replay}")
    assert pub.is_socket() and not pathlib.Path(f"{daemon.socket}.kv-tier").exists()
    kept = replayed(f"ipc://{replay}")
    assert kept is not None and isinstance(kept[0][1].events[0], AllBlocksCleared)
    assert not pathlib.Path(f"{daemon.socket}.kv-tier-replay").exists()


def probe_token_ids(tmp: pathlib.Path) -> None:
    """``KVELASTIC_TIER_EVENTS_TOKEN_IDS=0``: the tier's blocks without their token ids."""
    if __import__("tests.backend").backend.TEST_BACKEND != "host":
        pytest.skip("demotion source A reads memfd pages: host backend")
    daemon = demoted(tmp, KVELASTIC_TIER_EVENTS_TOKEN_IDS="0")
    try:
        kept = replayed(f"ipc://{daemon.socket}.kv-tier-replay")
        assert kept is not None
        hashes_only([e for topic, batch in kept if topic == TOPIC for e in batch.events if isinstance(e, BlockStored)])
    finally:
        daemon.stop()
