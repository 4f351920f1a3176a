"""Deployment files (daemon/) against the code, and the systemd readiness
protocol of a real daemon, without systemd.

The file checks are pure reads: the env file, the ConfigMap and the unit must
name exactly the variables of ``kvelastic.config.VARIABLES``; the Dockerfile
must build both flavours with the daemon as entry point. The process tests
start ``python -m kvelastic daemon`` with ``NOTIFY_SOCKET`` pointing at a
datagram socket of the test, as systemd does for ``Type=notify``.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from kvelastic import protocol as p
from kvelastic.config import VARIABLES, Config
from tests.deploy.manifests import DAEMON_DIR, README, ROOT, dockerfile_stages, load_daemonset_documents

ENV_FILE = DAEMON_DIR / "kvelastic.env"
UNIT_FILE = DAEMON_DIR / "kvelastic.service"

SYSTEMD_SOCKET = "/run/kvelastic/kvelastic.sock"
DEFAULTS = {v.name: v.default for v in VARIABLES}
EXPECTED = dict(DEFAULTS, KVELASTIC_SOCKET=SYSTEMD_SOCKET, KVELASTIC_KEEPER="external")   # the keeper's own unit
METRICS_PORT = int(DEFAULTS["KVELASTIC_METRICS_PORT"])


# ------------------------------------------------------------------ env file
def parse_env_file(text: str) -> list[tuple[str | None, str, str]]:
    """(comment just above, name, value) per assignment, with the rules shared by
    systemd's EnvironmentFile= and ``docker run --env-file`` (no quotes, no
    ``export``, no blanks around ``=``), which the file must keep to."""
    entries = []
    previous: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            previous = None
            continue
        if line.startswith("#"):
            previous = line[1:].strip()
            continue
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(\S*)", line)
        assert m, f"kvelastic.env line {number} is not NAME=value (no quotes, no blanks): {line!r}"
        entries.append((previous, m.group(1), m.group(2)))
        previous = None
    return entries


def test_env_file_lists_every_variable_with_its_default():
    entries = parse_env_file(ENV_FILE.read_text())
    names = [name for _, name, _ in entries]
    duplicated = sorted(n for n in names if names.count(n) > 1)
    assert len(names) == len(set(names)), f"duplicated in kvelastic.env: {duplicated}"
    assert set(names) == set(DEFAULTS), (
        f"kvelastic.env vs kvelastic.config.VARIABLES: missing {sorted(set(DEFAULTS) - set(names))}, "
        f"unknown {sorted(set(names) - set(DEFAULTS))}")
    values = {name: value for _, name, value in entries}
    assert values == EXPECTED


def test_env_file_documents_every_variable():
    for comment, name, _ in parse_env_file(ENV_FILE.read_text()):
        doc = next(v.doc for v in VARIABLES if v.name == name)
        assert comment == doc, f"the comment above {name} in kvelastic.env should be its doc: {doc!r}"


def test_env_file_is_a_valid_configuration():
    env = {name: value for _, name, value in parse_env_file(ENV_FILE.read_text())}
    config = Config.from_env(env)
    assert config.socket == SYSTEMD_SOCKET
    assert config.metrics_port == METRICS_PORT


# ---------------------------------------------------------------- unit file
def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        assert current is not None, f"setting outside a section: {line!r}"
        assert not line.endswith("\\"), "keep unit settings on one line"
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def unit_values(key: str) -> list[str]:
    return [v for k, v in parse_unit(UNIT_FILE.read_text()).get("Service", []) if k == key]


def unit_value(key: str) -> str:
    values = unit_values(key)
    assert len(values) == 1, f"kvelastic.service: expected one {key}=, found {values}"
    return values[0]


def test_unit_is_a_notify_service_with_runtime_directory():
    sections = parse_unit(UNIT_FILE.read_text())
    assert {"Unit", "Service", "Install"} <= set(sections)
    assert unit_value("Type") == "notify"
    assert unit_value("ExecStart").split()[1:] == ["daemon"]
    assert unit_value("ExecStart").split()[0].endswith("/kvelastic")
    assert unit_value("RuntimeDirectory") == "kvelastic"
    assert unit_value("RuntimeDirectoryMode") == "0750"
    assert unit_value("EnvironmentFile") == "-/etc/kvelastic/kvelastic.env"
    assert unit_value("Restart") == "on-failure"
    assert unit_value("RestartSec") == "1"
    assert unit_value("TimeoutStopSec") == "30"
    assert ("WantedBy", "multi-user.target") in sections["Install"]


def test_unit_socket_path_matches_runtime_directory():
    """Without KVELASTIC_SOCKET a non-root daemon would pick a per-user path."""
    env = dict(item.split("=", 1) for line in unit_values("Environment") for item in line.split())
    assert env.get("KVELASTIC_SOCKET") == SYSTEMD_SOCKET
    assert os.path.dirname(SYSTEMD_SOCKET) == "/run/" + unit_value("RuntimeDirectory")


def test_unit_limits_user_and_hardening():
    assert int(unit_value("LimitNOFILE")) >= 1 << 20
    assert unit_value("LimitMEMLOCK") == "infinity"
    assert unit_value("User") == "kvelastic"
    assert unit_value("Group") == "kvelastic"
    assert unit_value("UMask") == "0007"
    assert "video" in unit_value("SupplementaryGroups").split()
    assert unit_value("NoNewPrivileges") == "yes"
    assert unit_value("PrivateTmp") == "yes"
    # These break CUDA (device nodes, W+X mappings) or the device allow list.
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "DeviceAllow", "ProtectClock"):
        assert not unit_values(key), f"{key}= would break GPU access; see the unit's comments"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart exists: point it at an executable that does.
    text = UNIT_FILE.read_text().replace(unit_value("ExecStart").split()[0], sys.executable)
    unit = tmp_path / "kvelastic.service"
    unit.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "kvelastic.service" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


# --------------------------------------------------------------- Dockerfile
def test_dockerfile_has_cuda_and_host_targets():
    stages = dockerfile_stages()
    assert {"cuda", "host"} <= set(stages), f"targets: {sorted(stages)}"
    assert re.fullmatch(r"nvidia/cuda:[\w.]+-runtime-ubuntu(22|24)\.04", stages["cuda"][0][1]), stages["cuda"][0]
    assert stages["host"][0][1] == "python:3.11-slim"


@pytest.mark.parametrize("target", ["cuda", "host"])
def test_dockerfile_target_runs_the_daemon(target):
    stage = dockerfile_stages()[target]

    def args(instruction: str) -> list[str]:
        return [rest for ins, rest in stage if ins == instruction]

    assert args("ENTRYPOINT") == ['["kvelastic", "keeper", "--with-daemon"]']   # the kept cache survives a crash
    env = " ".join(args("ENV"))
    assert f"KVELASTIC_SOCKET={SYSTEMD_SOCKET}" in env
    assert args("VOLUME") == [os.path.dirname(SYSTEMD_SOCKET)]
    assert args("EXPOSE") == [str(METRICS_PORT)]
    healthcheck = " ".join(args("HEALTHCHECK"))
    assert re.search(r'CMD \["kvelastic", "status", "--json"\]', healthcheck), healthcheck
    runs = args("RUN")
    install = [i for i, run in enumerate(runs) if re.search(r"pip install \.(\s|$)", run)]
    assert install, f"{target}: no `pip install .`"
    if target == "host":
        torch = [i for i, run in enumerate(runs)
                 if "torch==2.13.0" in run and "--index-url https://download.pytorch.org/whl/cpu" in run]
        assert torch and torch[0] < install[0], "host: install the CPU torch before `pip install .`"
    # Whatever is copied from the build context (the repository root) exists.
    for copy in args("COPY"):
        for source in copy.split()[:-1]:
            if not source.startswith("--"):
                assert (ROOT / source).exists(), f"{target}: COPY {source} is not in the repository"


# ------------------------------------------------------------- Kubernetes
def test_configmap_has_every_variable():
    config_map = load_daemonset_documents()["ConfigMap"]
    assert config_map["metadata"] == {"name": "kvelastic-config", "namespace": "kvelastic"}
    data = config_map["data"]
    assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings (quote them)"
    assert set(data) == set(DEFAULTS), (
        f"ConfigMap vs kvelastic.config.VARIABLES: missing {sorted(set(DEFAULTS) - set(data))}, "
        f"unknown {sorted(set(data) - set(DEFAULTS))}")
    assert data == EXPECTED
    assert Config.from_env(data).socket == SYSTEMD_SOCKET


def test_daemonset_shares_the_socket_folder_and_probes_the_daemon():
    docs = load_daemonset_documents()
    ds = docs["DaemonSet"]
    assert ds["apiVersion"] == "apps/v1"
    assert ds["metadata"]["namespace"] == "kvelastic" == docs["Namespace"]["metadata"]["name"]
    pod = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    spec = pod["spec"]
    assert not spec.get("hostPID"), "hostPID is not needed: engines are tracked by socket, not pid"
    assert spec.get("runtimeClassName") == "nvidia"
    (container,) = spec["containers"]
    assert {"configMapRef": {"name": "kvelastic-config"}} in container["envFrom"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    resources = container["resources"]
    assert resources["requests"], "resource requests are required"
    for kind in ("requests", "limits"):
        assert "nvidia.com/gpu" not in resources.get(kind, {}), "the daemon must see every GPU, not request some"
    assert container["readinessProbe"]["exec"]["command"] == ["kvelastic", "status", "--json"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    socket_dir = os.path.dirname(docs["ConfigMap"]["data"]["KVELASTIC_SOCKET"])
    assert volumes[mounts[socket_dir]]["hostPath"] == {"path": "/run/kvelastic", "type": "DirectoryOrCreate"}
    (port,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert port["containerPort"] == int(docs["ConfigMap"]["data"]["KVELASTIC_METRICS_PORT"])
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port["containerPort"])


def test_readme_covers_the_operator_steps():
    text = README.read_text()
    for needle in ("useradd --system", "--group-add", "KVELASTIC_ENABLE=1", "-v /run/kvelastic:/run/kvelastic",
                   "--gpus all", "docker build -f daemon/Dockerfile", "daemonset.yaml"):
        assert needle in text, f"daemon/README.md should mention {needle!r}"


# ------------------------------------------- systemd readiness, no systemd
class NotifySocket:
    """The datagram socket systemd passes as $NOTIFY_SOCKET."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.received: list[str] = []

    def wait_for(self, state: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout
        while state not in self.received:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {state} on NOTIFY_SOCKET within {timeout} s; got {self.received}")
            self.sock.settimeout(min(left, 0.2))
            try:
                self.received += self.sock.recv(4096).decode().split("\n")
            except TimeoutError:
                if proc is not None and proc.poll() is not None and state not in self.received:
                    raise AssertionError(f"daemon exited with {proc.returncode} before {state}") from None

    def close(self) -> None:
        self.sock.close()


def daemon_env(sock: pathlib.Path, notify: NotifySocket | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET" and not k.startswith("KVELASTIC_")}
    # KVELASTIC_KEEPER as the units set it (their keeper is a unit of its own): under the default
    # ``auto`` each daemon here would start a keeper that outlives the test by its linger.
    env.update(KVELASTIC_SOCKET=str(sock), KVELASTIC_MEMORY="64MiB", KVELASTIC_BACKEND="host",
               KVELASTIC_METRICS_PORT="0", KVELASTIC_LOG_LEVEL="info", KVELASTIC_KEEPER="external")
    if notify is not None:
        env["NOTIFY_SOCKET"] = notify.path
    return env


def start_daemon(sock: pathlib.Path, notify: NotifySocket | None, log: pathlib.Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=daemon_env(sock, notify),
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def status(sock: pathlib.Path) -> dict:
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"ipc://{sock}")
        dealer.send(p.encode(p.Status(req_id=1)))
        assert dealer.poll(5000), "the daemon did not answer Status"
        reply = p.decode(dealer.recv())
        assert isinstance(reply, p.StatusReply), reply
        return msgspec.to_builtins(reply.status)
    finally:
        dealer.close(0)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def paths(tmp_path):
    # AF_UNIX paths are limited to 107 bytes: keep the names short.
    sock = tmp_path / "run" / "kv.sock"   # "run" does not exist: the daemon creates it
    notify = NotifySocket(tmp_path / "notify")
    yield sock, notify, tmp_path / "daemon.log"
    notify.close()


def test_ready_after_sockets_accept_and_graceful_sigterm(paths):
    sock, notify, log = paths
    proc = start_daemon(sock, notify, log)
    try:
        try:
            notify.wait_for("READY=1", 15, proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log.read_text(errors='replace')}") from None
        # READY=1 means both sockets accept connections right now.
        fd_sock = pathlib.Path(p.fd_socket_path(str(sock)))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(fd_sock))
        assert isinstance(status(sock), dict)
        for path in (sock, fd_sock):
            assert stat.S_ISSOCK(path.stat().st_mode)
            assert stat.S_IMODE(path.stat().st_mode) == 0o660, f"{path} should be 0660"
        assert stat.S_IMODE(sock.parent.stat().st_mode) & 0o007 == 0, "socket folder open to others"
        assert "STOPPING=1" not in notify.received

        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit within 10 s of SIGTERM\n{log.read_text(errors='replace')}") from None
        assert code == 0, log.read_text(errors="replace")
        notify.wait_for("STOPPING=1", 2)
        assert not sock.exists() and not fd_sock.exists(), "sockets left behind after a graceful stop"
    finally:
        stop(proc)


def test_second_daemon_on_the_same_socket_refuses_to_start(paths):
    sock, notify, log = paths
    first = start_daemon(sock, notify, log)
    try:
        notify.wait_for("READY=1", 15, first)
        second = subprocess.run([sys.executable, "-m", "kvelastic", "daemon"], env=daemon_env(sock, None),
                                capture_output=True, text=True, timeout=20, cwd=ROOT)
        assert second.returncode == 1, second.stderr
        assert "another kvelastic daemon" in second.stderr
        assert str(sock) in second.stderr
        # The refused daemon must not have taken the first one's sockets away.
        assert sock.exists() and pathlib.Path(p.fd_socket_path(str(sock))).exists()
        assert status(sock) is not None
        assert first.poll() is None
    finally:
        stop(first)


def test_restart_after_a_crash_replaces_stale_sockets(paths):
    """Restart=on-failure with RuntimeDirectoryPreserve=yes: the new daemon
    finds the dead one's socket files and must start anyway."""
    sock, notify, log = paths
    first = start_daemon(sock, notify, log)
    try:
        notify.wait_for("READY=1", 15, first)
    finally:
        stop(first)   # SIGKILL: no cleanup
    assert sock.exists(), "expected the killed daemon's socket to be left behind"
    notify.received.clear()
    second = start_daemon(sock, notify, log)
    try:
        notify.wait_for("READY=1", 15, second)
        assert status(sock) is not None
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(10) == 0
        stop(second)


def test_kv_event_sockets_are_private_and_removed_on_stop(tmp_path):
    sock = tmp_path / "run" / "k.sock"
    env = {**os.environ, "KVELASTIC_SOCKET": str(sock), "KVELASTIC_MEMORY": "64MiB", "KVELASTIC_BACKEND": "host",
           "KVELASTIC_METRICS_PORT": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "daemon"], env=env)
    events = [pathlib.Path(f"{sock}.kv-events"), pathlib.Path(f"{sock}.kv-events-replay")]
    try:
        deadline = time.monotonic() + 15
        while not all(p.exists() for p in events) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o660 for p in events)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    assert not any(p.exists() for p in events)


def test_a_squattable_socket_folder_is_refused(tmp_path):
    """A folder others can write (or that another user made, as with a
    predictable /tmp path) would let them delete or replace the sockets."""
    for mode, owner, says in ((0o777, None, "writable by every user"), (0o750, 65534, "belongs to uid 65534")):
        folder = tmp_path / f"squat-{mode:o}-{owner}"
        folder.mkdir()
        os.chmod(folder, mode)
        if owner is not None:
            if os.geteuid() != 0:
                continue                      # only root can hand a folder to another user
            os.chown(folder, owner, owner)
        out = subprocess.run([sys.executable, "-m", "kvelastic", "daemon"], env=daemon_env(folder / "kv.sock", None),
                             capture_output=True, text=True, timeout=20, cwd=ROOT)
        assert out.returncode == 1 and says in out.stderr and "KVELASTIC_SOCKET" in out.stderr, out.stderr
        assert not (folder / "kv.sock").exists()


KEEPER_UNIT = DAEMON_DIR / "kvelastic-keeper.service"


def test_the_keeper_runs_beside_the_daemon_under_systemd():
    """The daemon's unit wants the keeper and starts after it is ready; the
    keeper runs as the daemon's user on the same socket folder, and a
    restart of the daemon's unit does not touch it (no PartOf=)."""
    daemon = UNIT_FILE.read_text()
    assert "Wants=kvelastic-keeper.service" in daemon and "After=kvelastic-keeper.service" in daemon
    keeper = KEEPER_UNIT.read_text()
    for line in ("Type=notify", "User=kvelastic", "RuntimeDirectory=kvelastic", "RuntimeDirectoryPreserve=yes",
                 "Environment=KVELASTIC_SOCKET=/run/kvelastic/kvelastic.sock",
                 "ExecStart=/usr/local/bin/kvelastic keeper"):
        assert line in keeper.splitlines(), line
    assert "PartOf=" not in keeper and "BindsTo=" not in keeper
    assert "Environment=KVELASTIC_SOCKET=/run/kvelastic/kvelastic.sock" in daemon.splitlines()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_keeper_unit_passes_systemd_analyze_verify(tmp_path):
    unit = tmp_path / "kvelastic-keeper.service"
    unit.write_text(KEEPER_UNIT.read_text().replace("/usr/local/bin/kvelastic", sys.executable))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "kvelastic-keeper.service" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_the_daemonset_runs_the_keeper_as_a_sidecar_on_the_socket_folder():
    docs = load_daemonset_documents()
    spec = docs["DaemonSet"]["spec"]["template"]["spec"]
    (keeper,) = spec["initContainers"]
    (daemon,) = spec["containers"]
    assert keeper["restartPolicy"] == "Always"          # a native sidecar: up before the daemon, outlives its restarts
    assert keeper["command"] == ["kvelastic", "keeper"] and keeper["image"] == daemon["image"]
    assert keeper["envFrom"] == daemon["envFrom"]       # the same KVELASTIC_SOCKET
    socket_dir = os.path.dirname(docs["ConfigMap"]["data"]["KVELASTIC_SOCKET"])
    assert {m["mountPath"]: m["name"] for m in keeper["volumeMounts"]}[socket_dir] == \
        {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}[socket_dir]
    assert "runAsUser" not in keeper.get("securityContext", {})   # the pod's user: the daemon's
    assert keeper["startupProbe"]["exec"]["command"][-1] == docs["ConfigMap"]["data"]["KVELASTIC_SOCKET"] + ".keeper"


def test_the_keeper_says_ready_once_it_listens(tmp_path):
    """The keeper's unit is ``Type=notify``: READY=1 comes once its socket accepts."""
    notify = NotifySocket(tmp_path / "notify")
    sock = tmp_path / "kvelastic.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvelastic", "keeper"], env=daemon_env(sock, notify),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        notify.wait_for("READY=1", timeout=30, proc=proc)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(sock) + ".keeper")
    finally:
        proc.terminate()
        proc.wait(10)
        notify.close()
