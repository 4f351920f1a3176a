"""The router's Kubernetes manifest and llm-d's KV cache manager
configuration (daemon/kubernetes/router.yaml, daemon/llm-d/), against the
router's real argument parser and the documented engine settings. Pure reads."""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import pytest

from tests.deploy.manifests import DAEMON_DIR, README, ROOT, dockerfile_stages, load_daemonset_documents, load_documents

ROUTER = DAEMON_DIR / "kubernetes" / "router.yaml"
LLMD = DAEMON_DIR / "llm-d" / "kv-cache-manager.yaml"
KV_EVENTS_DOC = ROOT / "docs" / "kv-events.md"
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


