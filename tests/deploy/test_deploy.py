"""Deployment files (daemon/) against the code, and the systemd readiness
protocol of a real daemon, without systemd.

The file checks are pure reads: the env file, the ConfigMap and the unit must
name exactly the variables of ``kvelastic.config.VARIABLES``; the Dockerfile
must build both flavours with the daemon as entry point. The process tests
start ``python -m kvelastic daemon`` with ``NOTIFY_SOCKET`` pointing at a
datagram socket of the test, as systemd does for ``Type=notify``.
"""

from __future__ import annotations

import argparse
import json
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

ROOT = pathlib.Path(__file__).resolve().parents[2]
DAEMON_DIR = ROOT / "daemon"
ENV_FILE = DAEMON_DIR / "kvelastic.env"
UNIT_FILE = DAEMON_DIR / "kvelastic.service"
DOCKERFILE = DAEMON_DIR / "Dockerfile"
DAEMONSET = DAEMON_DIR / "kubernetes" / "daemonset.yaml"
ROUTER = DAEMON_DIR / "kubernetes" / "router.yaml"
LLMD = DAEMON_DIR / "llm-d" / "kv-cache-manager.yaml"
README = DAEMON_DIR / "README.md"
KV_EVENTS_DOC = ROOT / "docs" / "kv-events.md"

SYSTEMD_SOCKET = "/run/kvelastic/kvelastic.sock"
DEFAULTS = {v.name: v.default for v in VARIABLES}
EXPECTED = dict(DEFAULTS, KVELASTIC_SOCKET=SYSTEMD_SOCKET)
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
def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """target -> [(INSTRUCTION, arguments)], continuation lines joined, with the
    global ARG defaults substituted in FROM."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    args: dict[str, str] = {}
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        rest = rest.strip()
        if instruction == "ARG" and current is None and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
        if instruction == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            assert m, f"every FROM needs a target name: {line!r}"
            image = re.sub(r"\$\{(\w+)\}", lambda g: args.get(g.group(1), ""), m.group(1))
            current = stages.setdefault(m.group(2), [])
            current.append(("FROM", image))
            continue
        assert current is not None or instruction == "ARG", f"{instruction} before the first FROM"
        if current is not None:
            current.append((instruction, rest))
    return stages


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

    assert args("ENTRYPOINT") == ['["kvelastic", "daemon"]']
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
def load_documents(path: pathlib.Path) -> dict[str, dict]:
    """kind -> document, for a YAML file of documents of distinct kinds."""
    yaml = pytest.importorskip(
        "yaml", reason="PyYAML is not installed: add pyyaml to the test extras in pyproject.toml")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def load_daemonset_documents() -> dict[str, dict]:
    return load_documents(DAEMONSET)


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


# ------------------------------------------------- router and llm-d files
INDEXER_PORT = 8090          # python -m dynamo.indexer --port 8090 (binds 0.0.0.0)
ENGINE_ARG = re.compile(r"([1-9][0-9]*)=(http://[^,\s]+),(tcp://[^,\s]+),(tcp://[^,\s]+)")
KV_EVENTS_CONFIG = re.compile(r"'(\{\"enable_kv_cache_events\"[^']*\})'")


def router_pod() -> tuple[dict[str, dict], dict]:
    docs = load_documents(ROUTER)
    return docs, docs["Deployment"]["spec"]["template"]


def pod_containers(spec: dict) -> dict[str, dict]:
    """Every container of a pod spec by name, native sidecars (init containers) included."""
    containers = spec.get("initContainers", []) + spec["containers"]
    names = [c["name"] for c in containers]
    assert len(names) == len(set(names)), names
    return {c["name"]: c for c in containers}


def router_argv(container: dict) -> list[str]:
    """The router container's arguments after ``kvelastic router``."""
    assert container["command"][:2] == ["kvelastic", "router"], container["command"]
    argv = container["command"][2:] + container.get("args", [])
    assert all(isinstance(a, str) for a in argv), f"Kubernetes takes only strings as args (quote numbers): {argv}"
    return argv


def option_values(argv: list[str], name: str) -> list[str]:
    values = []
    for i, arg in enumerate(argv):
        if arg == name:
            values.append(argv[i + 1])
        elif arg.startswith(name + "="):
            values.append(arg[len(name) + 1:])
    return values


def option_value(argv: list[str], name: str) -> str:
    values = option_values(argv, name)
    assert len(values) == 1, f"expected one {name}, found {values}"
    return values[0]


def port_of(endpoint: str) -> int:
    m = re.fullmatch(r"[a-z]+://(\[[^\]]+\]|[^:/]+):([0-9]+)/?", endpoint)
    assert m, f"expected SCHEME://HOST:PORT, got {endpoint!r}"
    return int(m.group(2))


def host_of(endpoint: str) -> str:
    return endpoint.split("://", 1)[1].rsplit(":", 1)[0]


def router_port(container: dict) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
    return port


def documented_block_size() -> int:
    """The engines' ``--block-size`` in docs/kv-events.md."""
    sizes = set(re.findall(r"--block-size[ =]([0-9]+)", KV_EVENTS_DOC.read_text()))
    assert len(sizes) == 1, f"docs/kv-events.md: expected one --block-size, found {sizes}"
    return int(sizes.pop())


def documented_kv_events_configs(path: pathlib.Path) -> list[dict]:
    """The ``--kv-events-config`` JSON objects a file shows (in comments or shell snippets)."""
    return [json.loads(m) for m in KV_EVENTS_CONFIG.findall(path.read_text())]


def test_router_manifest_has_deployment_service_and_network_policy():
    docs = load_documents(ROUTER)
    assert set(docs) == {"Deployment", "Service", "NetworkPolicy"}
    namespace = load_daemonset_documents()["Namespace"]["metadata"]["name"]
    for doc in docs.values():
        assert doc["metadata"]["namespace"] == namespace, doc["kind"]
    assert docs["Deployment"]["apiVersion"] == "apps/v1"
    assert docs["Service"]["apiVersion"] == "v1"
    assert docs["NetworkPolicy"]["apiVersion"] == "networking.k8s.io/v1"


def test_router_pod_is_locked_down_like_the_daemon():
    docs, pod = router_pod()
    deployment, daemonset = docs["Deployment"], load_daemonset_documents()["DaemonSet"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ds_selector = daemonset["spec"]["selector"]["matchLabels"]
    assert not ds_selector.items() <= labels.items(), "the router's pods must not match the DaemonSet's selector"
    spec = pod["spec"]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(key), f"{key}: the indexer binds 0.0.0.0, keep it in the pod's own network"
    security = spec["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    volumes = {v["name"]: v for v in spec["volumes"]}
    for name, container in pod_containers(spec).items():
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"]["drop"] == ["ALL"], name
        assert container["resources"]["requests"], f"{name}: resource requests are required"
        assert container["resources"]["limits"]["memory"], f"{name}: a memory limit is required"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], f"{name}: a writable /tmp (the root filesystem is read-only)"
        for port in container.get("ports", []):
            assert "hostPort" not in port, name


def test_router_runs_the_daemon_image_and_probes_health():
    _, pod = router_pod()
    router = pod_containers(pod["spec"])["router"]
    (daemon,) = load_daemonset_documents()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    repository, _, tag = router["image"].rpartition(":")
    assert repository == daemon["image"].rpartition(":")[0], "the router runs the daemon's image"
    assert tag in dockerfile_stages(), f"{router['image']}: tag it after a daemon/Dockerfile target"
    port = router_port(router)
    for probe in ("readinessProbe", "livenessProbe"):
        get = router[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ("http", port), probe
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_router_arguments_name_the_indexer_and_the_engines():
    _, pod = router_pod()
    router = pod_containers(pod["spec"])["router"]
    argv = router_argv(router)
    assert option_value(argv, "--listen") == f"0.0.0.0:{router_port(router)}"
    assert option_value(argv, "--indexer") == f"http://127.0.0.1:{INDEXER_PORT}", "the indexer is in the pod"
    assert int(option_value(argv, "--block-size")) == documented_block_size()
    assert "@" not in option_value(argv, "--model"), "llm-d splits KV event topics on '@'"
    assert option_values(argv, "--policy") in ([], ["kv"])
    engines = option_values(argv, "--engine")
    assert engines, "list at least one --engine"
    documented = documented_kv_events_configs(KV_EVENTS_DOC)
    assert documented, "docs/kv-events.md shows no --kv-events-config"
    ids = []
    for engine in engines:
        m = ENGINE_ARG.fullmatch(engine)
        assert m, f"--engine {engine!r}: expected ID=HTTP_URL,EVENTS_ENDPOINT,REPLAY_ENDPOINT"
        ids.append(int(m.group(1)))
        url, events, replay = m.group(2, 3, 4)
        assert host_of(url) == host_of(events) == host_of(replay), f"--engine {engine}: one engine, one host"
        port_of(url)
        # The ports vLLM binds with the documented --kv-events-config.
        assert port_of(events) == port_of(documented[0]["endpoint"]), engine
        assert port_of(replay) == port_of(documented[0]["replay_endpoint"]), engine
    assert len(ids) == len(set(ids)), f"engine ids must be unique: {ids}"


def test_router_arguments_parse_with_the_router_parser():
    from kvelastic.cli import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if "router" not in commands.choices:
        pytest.skip("no `kvelastic router` command yet")
    _, pod = router_pod()
    argv = router_argv(pod_containers(pod["spec"])["router"])
    args = parser.parse_args(["router", *argv])
    assert args.model == option_value(argv, "--model")
    assert args.block_size == documented_block_size()
    assert len(args.engine) == len(option_values(argv, "--engine"))
    for engine in args.engine:
        assert engine.events and engine.replay, f"{engine}: the indexer needs its event and replay endpoints"


def test_indexer_sidecar_is_reached_only_from_inside_the_pod():
    docs, pod = router_pod()
    containers = pod_containers(pod["spec"])
    indexer = containers["indexer"]
    command = indexer["command"]
    assert command[:3] == ["python", "-m", "dynamo.indexer"], command
    assert option_value(command, "--port") == str(INDEXER_PORT)
    assert option_value(command, "--threads") == "1"
    if indexer in pod["spec"].get("initContainers", []):
        assert indexer.get("restartPolicy") == "Always", "an init container must be a native sidecar"
    assert not indexer.get("ports"), "declare no port for the indexer: it is the router's alone"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in indexer:
            assert "exec" in indexer[probe], f"indexer {probe}: exec, so no network path to {INDEXER_PORT} is needed"
    for name, container in containers.items():
        for port in container.get("ports", []):
            assert port["containerPort"] != INDEXER_PORT, name

    router = containers["router"]
    named = {p["name"]: p["containerPort"] for p in router["ports"]}

    def resolve(port: int | str) -> int:
        return named[port] if isinstance(port, str) else port

    labels = pod["metadata"]["labels"]
    service = docs["Service"]["spec"]
    assert service.get("type", "ClusterIP") == "ClusterIP"
    assert service["selector"].items() <= labels.items()
    assert [resolve(p.get("targetPort", p["port"])) for p in service["ports"]] == [router_port(router)]
    assert [p["port"] for p in service["ports"]] == [router_port(router)]

    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["policyTypes"]
    assert policy["ingress"], "no ingress rule: the router would be unreachable"
    for rule in policy["ingress"]:
        assert rule.get("ports"), "an ingress rule without ports admits every port, the indexer's included"
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            assert "endPort" not in port
            assert resolve(port["port"]) == router_port(router), port


# Field names of llm-d-kv-cache v0.8.1's JSON configuration, as the
# precise-prefix-cache-scorer takes it (pkg/kvcache/kvblock/token_processor.go,
# pkg/kvcache/indexer.go, pkg/kvcache/kvblock/{index,in_memory,cost_aware_memory,
# redis}.go, pkg/tokenization/{pool_uds,uds_tokenizer}.go, pkg/kvevents/pool.go;
# the same in v0.8.0). Go's encoding/json ignores unknown names: a misspelt one
# would be dropped without a word.
_REDIS = {"address": str, "backendType": str, "enableRDMA": bool}
LLMD_SCORER_SCHEMA: dict = {
    "tokenProcessorConfig": {"blockSize": int, "blockSizeTokens": int, "hashSeed": str},
    "indexerConfig": {
        "kvBlockIndexConfig": {
            "inMemoryConfig": {"size": int, "podCacheSize": int},
            "costAwareMemoryConfig": {"size": str},
            "redisConfig": _REDIS,
            "valkeyConfig": _REDIS,
            "enableMetrics": bool,
            "metricsLoggingInterval": int,      # a Go time.Duration: nanoseconds
        },
        "kvCacheBackendConfigs": list,
        "tokenizersPoolConfig": {"modelName": str, "workersCount": int,
                                 "uds": {"socketFile": str, "useTCP": bool, "modelTokenizerMap": dict}},
    },
    "kvEventsConfig": {
        "zmqEndpoint": str, "topicFilter": str, "concurrency": int, "engineType": str, "discoverPods": bool,
        "podDiscoveryConfig": {"podLabelSelector": str, "podNamespace": str, "socketPort": int},
    },
    "speculativeIndexing": bool,
    "speculativeTTL": int,
}


def check_fields(value: object, schema: object, path: str) -> None:
    if isinstance(schema, dict):
        assert isinstance(value, dict), f"{path}: expected an object, got {value!r}"
        for key, item in value.items():
            assert key in schema, f"{path}.{key}: not a field of llm-d-kv-cache's configuration"
            check_fields(item, schema[key], f"{path}.{key}")
    else:
        assert isinstance(schema, type)
        ok = isinstance(value, schema) and not (schema is int and isinstance(value, bool))
        assert ok, f"{path}: expected {schema.__name__}, got {value!r} (quote strings such as hashSeed)"


def llmd_config() -> tuple[dict, dict]:
    """The EndpointPickerConfig and its precise-prefix-cache-scorer's parameters."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    (config,) = [d for d in yaml.safe_load_all(LLMD.read_text()) if d]
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    return config, scorer["parameters"]


def test_llmd_config_uses_only_known_fields_and_references():
    config, params = llmd_config()
    check_fields(params, LLMD_SCORER_SCHEMA, "precise-prefix-cache-scorer.parameters")
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    for source in config.get("dataLayer", {}).get("sources", []):
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source.get("extractors", []))]
    assert set(refs) <= declared, f"undeclared plugins: {sorted(set(refs) - declared)}"
    assert "precise-prefix-cache-scorer" in refs


def test_llmd_config_matches_the_engines():
    _, params = llmd_config()
    block = documented_block_size()
    tokens = params["tokenProcessorConfig"]
    assert tokens["blockSize"] == tokens["blockSizeTokens"] == block, "llm-d's block size is the engines' --block-size"
    assert isinstance(tokens["hashSeed"], str) and tokens["hashSeed"]
    _, pod = router_pod()
    argv = router_argv(pod_containers(pod["spec"])["router"])
    model = option_value(argv, "--model")
    assert int(option_value(argv, "--block-size")) == block
    assert params["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == model

    events = params["kvEventsConfig"]
    assert events["engineType"] == "vllm"
    # vLLM binds tcp://*:5557 on each engine: llm-d dials every pod (pod
    # discovery); zmqEndpoint would make it bind and wait for engines to connect.
    assert events["discoverPods"] is True and "zmqEndpoint" not in events
    socket_port = events["podDiscoveryConfig"]["socketPort"]
    for engine in option_values(argv, "--engine"):
        m = ENGINE_ARG.fullmatch(engine)
        assert m and port_of(m.group(3)) == socket_port, engine

    # The engine flags both files show: one --kv-events-config, the one llm-d
    # and the router both read, publishing where llm-d dials.
    shown = documented_kv_events_configs(LLMD) + documented_kv_events_configs(ROUTER)
    assert len(shown) == 2 and shown[0] == shown[1], shown
    kv = shown[0]
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    assert kv["endpoint"] == f"tcp://*:{socket_port}", "vLLM must bind the port llm-d dials"
    assert port_of(kv["replay_endpoint"]) != socket_port
    documented = documented_kv_events_configs(KV_EVENTS_DOC)[0]
    assert (kv["endpoint"], kv["replay_endpoint"]) == (documented["endpoint"], documented["replay_endpoint"])
    topic = kv["topic"]
    assert topic.startswith(events["topicFilter"]) and events["topicFilter"] == "kv@"
    parts = topic.split("@")
    assert len(parts) == 3, f"llm-d reads kv@<pod>@<model>: {topic!r}"
    pod_id, topic_model = parts[1], parts[2]
    assert topic_model == model
    engine_url = ENGINE_ARG.fullmatch(option_values(argv, "--engine")[0]).group(2)
    assert pod_id == f"$(POD_IP):{port_of(engine_url)}", "llm-d knows an engine by its pod address:port"


def test_llmd_header_says_untested_and_cites_its_source():
    head = "".join(line for line in LLMD.read_text().splitlines(keepends=True) if line.startswith("#"))
    assert "UNTESTED" in head
    for needle in ("llm-d/llm-d-kv-cache v0.8.1", "0030c3ba64e13a0894d8e1b105a266039a24e756",
                   "019a3f3fb1c1ef672194408d3427e7ecd770b8bb", "PYTHONHASHSEED", "--block-size",
                   "--prefix-caching-hash-algo"):
        assert needle in head, f"daemon/llm-d/kv-cache-manager.yaml's header should mention {needle!r}"


def test_readme_covers_the_router_and_llmd_files():
    text = README.read_text()
    for needle in ("kubernetes/router.yaml", "llm-d/kv-cache-manager.yaml", "dynamo.indexer", "NetworkPolicy"):
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
    env.update(KVELASTIC_SOCKET=str(sock), KVELASTIC_MEMORY="64MiB", KVELASTIC_BACKEND="host",
               KVELASTIC_METRICS_PORT="0", KVELASTIC_LOG_LEVEL="info")
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
