"""The one place where ``KVELASTIC_*`` environment variables are read.

Every variable is declared once in ``VARIABLES`` with its default, its parser
and a line of documentation; the README table and ``daemon/kvelastic.env`` are
checked against this list by the tests. A bad value raises ``ConfigError``
naming the variable, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from kvelastic.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_DURATIONS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "": 1.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``512MiB``, ``8GiB``, ``2M``, ``1048576`` -> bytes."""
    m = _NUMBER_UNIT.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 512MiB, 8GiB or 1048576, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_optional_size(text: str) -> int | None:
    """A size, or ``0``/``none``/``unlimited`` for no limit."""
    if text.strip().lower() in ("", "0", "none", "unlimited"):
        return None
    return parse_size(text)


def parse_memory(text: str) -> int | float:
    """A size in bytes (``40GiB``) or a fraction of the device (``0.9``)."""
    stripped = text.strip()
    try:
        value = float(stripped)
    except ValueError:
        return parse_size(stripped)
    if 0.0 < value <= 1.0 and "." in stripped:
        return value
    if value >= 1 and value == int(value):
        return int(value)
    raise ValueError(f"expected a fraction in (0, 1] such as 0.9 or a size such as 40GiB, got {text!r}")


def parse_duration(text: str) -> float:
    """``30s``, ``500ms``, ``5m``, ``1h``, ``2.5`` (seconds) -> seconds."""
    m = _NUMBER_UNIT.match(text)
    if not m or m.group(2).lower() not in _DURATIONS:
        raise ValueError(f"expected a duration such as 30s, 500ms or 5m, got {text!r}")
    return float(m.group(1)) * _DURATIONS[m.group(2).lower()]


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 1/0, true/false, yes/no or on/off, got {text!r}")


def parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return lowered

    return parse


def parse_port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"expected a TCP port 0-65535, got {text!r}")
    return port


def _positive_int(text: str, most: int | None = None) -> int:
    value = int(text)
    if value < 1 or (most is not None and value > most):
        raise ValueError(f"expected a positive integer{f' up to {most}' if most else ''}, got {text!r}")
    return value


def parse_names(text: str) -> tuple[str, ...]:
    """``0,1`` -> ("0", "1"); empty: none. Names are short printable words."""
    names = tuple(n.strip() for n in text.split(",")) if text.strip() else ()
    bad = [n for n in names if not n or len(n) > 64 or not n.isprintable() or " " in n]
    if bad:
        raise ValueError(f"expected comma-separated device names such as 0,1, got {text!r}")
    return names


def parse_directory(text: str) -> str:
    """An absolute directory path, or empty for none."""
    path = text.strip()
    if path and not os.path.isabs(path):
        raise ValueError(f"expected an absolute directory path (or nothing), got {text!r}")
    return path


def parse_file(text: str) -> str:
    """An absolute file path, or empty for none."""
    path = text.strip()
    if path and not os.path.isabs(path):
        raise ValueError(f"expected an absolute file path (or nothing), got {text!r}")
    return path


# ZMQ's Z85 alphabet: a CURVE key is 32 bytes, 40 characters of it.
_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


def parse_curve_keys(text: str) -> tuple[str, ...]:
    """``KEY1,KEY2`` (Z85 CURVE public keys) -> ("KEY1", "KEY2"); empty: none."""
    keys = tuple(k.strip() for k in text.split(",")) if text.strip() else ()
    bad = [k for k in keys if not _Z85_KEY.match(k)]
    if bad:
        raise ValueError(f"expected comma-separated CURVE public keys (40 Z85 characters each), got {text!r}")
    return keys


def parse_power_of_two_size(text: str) -> int:
    size = parse_size(text)
    if size < 4096 or size & (size - 1):
        raise ValueError(f"expected a power of two of at least 4KiB such as 2MiB, got {text!r}")
    return size


def default_socket() -> str:
    """``/run/kvelastic/`` for root (systemd's RuntimeDirectory), else per user."""
    if os.geteuid() == 0:
        return "/run/kvelastic/kvelastic.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "kvelastic", "kvelastic.sock")
    return f"/tmp/kvelastic-{os.getuid()}/kvelastic.sock"


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    field: str
    default: str
    parse: Callable[[str], Any]
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable("KVELASTIC_ENABLE", "enable", "0", parse_bool,
             "vLLM plugin switch: the plugin does nothing unless this is 1."),
    Variable("KVELASTIC_BACKEND", "backend", "auto", parse_choice("auto", "cuda", "host"),
             "Physical memory backend: `cuda` (CUDA VMM), `host` (memfd pages), `auto` (cuda when a GPU is usable)."),
    Variable("KVELASTIC_MEMORY", "memory", "0.5", parse_memory,
             "Device pool budget for KV cache: bytes with a unit (`40GiB`) or a fraction of the device (`0.5`)."),
    Variable("KVELASTIC_HOST_DEVICES", "host_devices", "1", lambda t: _positive_int(t, 64),
             "Daemon, host backend: pools of host memory (devices `0`, `1`, ...), which share the "
             "`KVELASTIC_MEMORY` budget evenly; workers choose theirs with `KVELASTIC_WORKER_DEVICES` (one per "
             "CPU socket of a multi-socket box, say). On CUDA every GPU is a device of its own."),
    Variable("KVELASTIC_PAGE_SIZE", "page_size", "2MiB", parse_power_of_two_size,
             "Physical page size; a power of two and a multiple of the backend granularity (CUDA: 2MiB)."),
    Variable("KVELASTIC_SOCKET", "socket", "", str,
             "Daemon socket path. Default: `/run/kvelastic/kvelastic.sock` as root, else "
             "`$XDG_RUNTIME_DIR/kvelastic/kvelastic.sock` or `/tmp/kvelastic-$UID/kvelastic.sock`."),
    Variable("KVELASTIC_METRICS_PORT", "metrics_port", "18477", parse_port,
             "Prometheus `/metrics` HTTP port (0 disables the endpoint). Outside Prometheus's exporter "
             "range 9100-9999, which its default-port list has exhausted, and the 10000+ block it continues in."),
    Variable("KVELASTIC_METRICS_ADDR", "metrics_addr", "0.0.0.0", str,
             "Address the metrics endpoint binds."),
    Variable("KVELASTIC_KV_EVENTS_ENDPOINT", "kv_events_endpoint", "", str,
             "ZMQ PUB endpoint of the node's KV events (vLLM's format), e.g. `tcp://*:5557`; default "
             "`ipc://<socket>.kv-events`; `off` disables them."),
    Variable("KVELASTIC_KV_EVENTS_REPLAY_ENDPOINT", "kv_events_replay_endpoint", "", str,
             "ZMQ ROUTER endpoint for replays of missed KV event batches; default: the PUB endpoint "
             "with `-replay` appended (ipc) or the next port (tcp)."),
    Variable("KVELASTIC_KV_EVENTS_BUFFER", "kv_events_buffer", "10000", lambda t: _positive_int(t),
             "KV event batches kept for replay."),
    Variable("KVELASTIC_PREFIX_CACHE_MAX_SIZE", "prefix_cache_max_size", "0", parse_optional_size,
             "Maximum size of cached (evictable) prefix blocks per engine; `0` means bounded only by memory."),
    Variable("KVELASTIC_PREFIX_CACHE_TTL", "prefix_cache_ttl", "0", parse_duration,
             "Cached blocks unused for longer than this are evicted; `0` disables the TTL."),
    Variable("KVELASTIC_ENGINE_ID", "engine_id", "", str,
             "vLLM plugin: this engine's name in the daemon, metrics and logs (default: host name and process id)."),
    Variable("KVELASTIC_ENGINE_MIN_MEMORY", "engine_min_memory", "0", parse_size,
             "vLLM plugin: memory this engine is guaranteed (never reclaimed below it)."),
    Variable("KVELASTIC_ENGINE_MAX_MEMORY", "engine_max_memory", "0", parse_size,
             "vLLM plugin: the most this engine may hold; `0` means up to the device budget."),
    Variable("KVELASTIC_WORKER_DEVICES", "worker_devices", "", parse_names,
             "vLLM plugin: the daemon device of each worker rank, comma-separated (rank r takes entry r modulo "
             "their number), e.g. `0,1`. Default: on CUDA each worker's own GPU, by its UUID (whatever index "
             "`CUDA_VISIBLE_DEVICES` gives it); on host memory the daemon's first device."),
    Variable("KVELASTIC_TENANT_SALT", "tenant_salt", "", str,
             "vLLM plugin: a tenant's salt, part of the namespace, so blocks of different tenants never match."),
    Variable("KVELASTIC_PRIVATE_CACHE", "private_cache", "0", parse_bool,
             "vLLM plugin: `1` keeps this engine's prefix cache its own: never handed to or from another engine, "
             "never kept after it exits. For engines whose weights change in memory by a path vLLM's API does "
             "not show (RL rollouts that write parameters directly); see docs/kv-identity.md."),
    Variable("KVELASTIC_SOCKET_GROUP", "socket_group", "", str,
             "Daemon: the group (name or id) whose members may connect besides the daemon's own user and root; "
             "its sockets are given to it. Default: the daemon's own group."),
    Variable("KVELASTIC_OPERATOR_GROUP", "operator_group", "", str,
             "Daemon: the group (name or id) whose members are operators besides root and the daemon's own user: "
             "they may change limits, invalidate caches and register engines with a guaranteed minimum. "
             "Default: none."),
    Variable("KVELASTIC_MAX_ENGINES", "max_engines", "256", lambda t: _positive_int(t),
             "Daemon: the most engines it registers at once (each costs a little memory and a few descriptors)."),
    Variable("KVELASTIC_ACK_TIMEOUT", "ack_timeout", "5s", parse_duration,
             "Daemon: every worker of an engine must acknowledge a map or unmap within this; an engine that "
             "misses it is failed and its pages are quarantined (never re-lent) until its processes are gone."),
    Variable("KVELASTIC_GROW_TIMEOUT", "grow_timeout", "5s", parse_duration,
             "Daemon: every grow request is answered within this, with the slabs granted so far (slabs mapped "
             "later are still granted, on their own)."),
    Variable("KVELASTIC_IDLE_GRACE", "idle_grace", "5s", parse_duration,
             "Daemon: an engine with no model activity for this long is idle: its reserve (empty slabs) goes "
             "back, it grows no more until it has demand, and its cached memory is the first to yield."),
    Variable("KVELASTIC_HOLD_DOWN", "hold_down", "2s", parse_duration,
             "Daemon: memory moved from one engine to another is not moved back within this, whatever its "
             "demand (no ping-pong)."),
    Variable("KVELASTIC_ORPHAN_CACHE_TTL", "orphan_cache_ttl", "10m", parse_duration,
             "Daemon: a departed engine's valid cached slabs are kept this long for the next engine of its "
             "namespace (warm restart), as the first memory to yield; `0` drops them at once."),
    Variable("KVELASTIC_KEEPER", "keeper", "auto", parse_choice("auto", "external", "off"),
             "Daemon: the keeper that holds its pages so that the kept cache survives a crash or a restart. "
             "`auto`: the one listening beside the socket, else one the daemon starts, which outlives it; "
             "`external`: only one already listening (systemd's `kvelastic-keeper.service`, the DaemonSet's "
             "sidecar); `off`: none, pages die with the daemon."),
    Variable("KVELASTIC_KEEPER_LINGER", "keeper_linger", "5m", parse_duration,
             "Daemon: a keeper it started lets go of its pages and exits after this long with no daemon "
             "connected (a keeper run on its own stays until stopped)."),
    Variable("KVELASTIC_TIER_DIR", "tier_dir", "", parse_directory,
             "Daemon: a local directory (absolute) for the node's disk tier, shared by every engine: blocks "
             "that leave device memory kept by value, and checked (HMAC-SHA256) on every read; rebuilt from what "
             "the directory holds when the daemon starts. Empty: no tier. Departed engines' kept cache (when "
             "it expires, yields, or goes to another engine), cached slabs reclaimed from running engines and "
             "the blocks running engines are about to evict are demoted there (host backend); engines load "
             "them back through KvelasticTierConnector (docs/tier.md)."),
    Variable("KVELASTIC_TIER_SIZE", "tier_size", "8GiB", parse_size,
             "Daemon: the disk tier's budget; when it is full the blocks of least value (hits, decayed, times "
             "cost per byte) go first."),
    Variable("KVELASTIC_TIER_HOST_SIZE", "tier_host_size", "0", parse_optional_size,
             "Daemon: the node's tier in host memory the daemon owns (memfd pages, charged to the daemon's "
             "cgroup): its budget, shared by every engine. With `KVELASTIC_TIER_DIR` it sits above the disk: "
             "blocks enter it and the least valuable move down to the disk (then leave by value); alone, the "
             "tier is in memory only. `0`: none. It does not outlive the daemon (docs/tier.md)."),
    Variable("KVELASTIC_TIER_EVENTS_ENDPOINT", "tier_events_endpoint", "", str,
             "Daemon, with a tier: ZMQ PUB endpoint of the tier stream (docs/kv-events.md), whose events carry "
             "every tenant's token ids. Default: beside an ipc:// node stream (`ipc://<socket>.kv-tier`, only the "
             "daemon's user and root may connect), off beside a tcp:// one; `off` disables it. An endpoint that "
             "is not ipc:// needs CURVE (`KVELASTIC_TIER_EVENTS_CURVE_CERT`) or "
             "`KVELASTIC_TIER_EVENTS_TOKEN_IDS=0`, else the daemon refuses to start."),
    Variable("KVELASTIC_TIER_EVENTS_REPLAY_ENDPOINT", "tier_events_replay_endpoint", "", str,
             "Daemon: ZMQ ROUTER endpoint for replays of the tier stream, under the same rules; default: its "
             "PUB endpoint with `-replay` appended (ipc) or the next port (tcp)."),
    Variable("KVELASTIC_TIER_EVENTS_TOKEN_IDS", "tier_events_token_ids", "1", parse_bool,
             "Daemon: `0` strips the tier stream's stored blocks to their hashes, parents, block size and group "
             "(no token ids, LoRA, extra keys), on both its sockets; such a stream may go on TCP without CURVE."),
    Variable("KVELASTIC_TIER_EVENTS_CURVE_CERT", "tier_events_curve_cert", "", parse_file,
             "Daemon: absolute path of the tier stream's CURVE server certificate (ZMQ's format with its "
             "`secret-key`, as `zmq.auth.create_certificates` writes it), owned by the daemon's user and "
             "readable by no one else. With it both tier sockets speak CURVE and take only the subscribers of "
             "`KVELASTIC_TIER_EVENTS_CURVE_CLIENTS`."),
    Variable("KVELASTIC_TIER_EVENTS_CURVE_CLIENTS", "tier_events_curve_clients", "", parse_curve_keys,
             "Daemon: the CURVE public keys (Z85, 40 characters, comma-separated) of the subscribers the tier "
             "stream takes under CURVE (the router's, the indexer's); any other key is refused."),
    Variable("KVELASTIC_LOG_LEVEL", "log_level", "info", parse_choice("debug", "info", "warning", "error"),
             "Log level of the daemon and the client."),
)


@dataclasses.dataclass(frozen=True)
class Config:
    enable: bool
    backend: str
    memory: int | float
    host_devices: int
    page_size: int
    socket: str
    metrics_port: int
    metrics_addr: str
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    kv_events_buffer: int
    prefix_cache_max_size: int | None
    prefix_cache_ttl: float
    engine_id: str
    engine_min_memory: int
    engine_max_memory: int
    worker_devices: tuple[str, ...]
    tenant_salt: str
    private_cache: bool
    socket_group: str
    operator_group: str
    max_engines: int
    ack_timeout: float
    grow_timeout: float
    idle_grace: float
    hold_down: float
    orphan_cache_ttl: float
    keeper: str
    keeper_linger: float
    tier_dir: str
    tier_size: int
    tier_host_size: int | None
    tier_events_endpoint: str
    tier_events_replay_endpoint: str
    tier_events_token_ids: bool
    tier_events_curve_cert: str
    tier_events_curve_clients: tuple[str, ...]
    log_level: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Read and validate every variable; the first bad one raises ``ConfigError``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var in VARIABLES:
            raw = env.get(var.name, var.default)
            try:
                values[var.field] = var.parse(raw)
            except ValueError as exc:
                raise ConfigError(f"{var.name}={raw!r}: {exc}") from None
        if not values["socket"]:
            values["socket"] = default_socket()
        if not values["kv_events_endpoint"]:
            values["kv_events_endpoint"] = f"ipc://{values['socket']}.kv-events"
        if values["kv_events_endpoint"] == "off":
            values["kv_events_endpoint"] = ""
        if values["kv_events_endpoint"] and not values["kv_events_replay_endpoint"]:
            values["kv_events_replay_endpoint"] = replay_endpoint_for(values["kv_events_endpoint"])
        values["tier_events_endpoint"], values["tier_events_replay_endpoint"] = tier_endpoints(
            values["tier_events_endpoint"], values["tier_events_replay_endpoint"], values["kv_events_endpoint"])
        return cls(**values)


def replay_endpoint_for(endpoint: str) -> str:
    """vLLM's convention: the replay socket sits beside the PUB socket."""
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1].isdigit():
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + 1}"
    return endpoint + "-replay"


def tier_endpoint_for(endpoint: str) -> str:
    """The tier stream's endpoint beside a node stream's ipc endpoint:
    ``ipc://<socket>.kv-events`` -> ``ipc://<socket>.kv-tier`` (no longer
    than the node's, within a socket path's bound), another ``ipc://PATH``
    -> ``ipc://PATH.tier``."""
    if ".kv-events" in endpoint:
        head, _, tail = endpoint.rpartition(".kv-events")
        return f"{head}.kv-tier{tail}"
    return endpoint + ".tier"


def tier_endpoints(endpoint: str, replay: str, node: str) -> tuple[str, str]:
    """The tier stream's (PUB, ROUTER) endpoints, ("", "") when it is off.
    Unset, it sits beside an ipc node stream, whose socket files only the
    daemon's user may connect to; beside a TCP node stream it stays off: its
    events carry every tenant's token ids, and TCP checks no one."""
    if endpoint == "off" or (not endpoint and not node.startswith("ipc://")):
        return "", ""
    endpoint = endpoint or tier_endpoint_for(node)
    return endpoint, replay or replay_endpoint_for(endpoint)


def markdown_table() -> str:
    """The README's configuration table, generated from ``VARIABLES``."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for var in VARIABLES:
        rows.append(f"| `{var.name}` | `{var.default}` | {var.doc} |")
    return "\n".join(rows)
