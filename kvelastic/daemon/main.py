"""``kvelastic daemon``: configuration, backend, metrics endpoint, signals, loop."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import stat
import sys
import time

from kvelastic import protocol as p
from kvelastic.config import Config
from kvelastic.daemon.devices import Device
from kvelastic.daemon.events import tier_stream
from kvelastic.daemon.keeping import PageKeeper
from kvelastic.daemon.peers import Access
from kvelastic.daemon.requests import Timing
from kvelastic.daemon.server import Daemon
from kvelastic.daemon.statefile import boot_id
from kvelastic.daemon.tenancy import Tenancy
from kvelastic.errors import ConfigError, KvelasticError
from kvelastic.protocol import fd_socket_path
from kvelastic.startup import configured, sd_notify
from kvelastic.tier.index import TierIndex
from kvelastic.tier.media import UntrustedTier, open_store
from kvelastic.tier.restart import rebuild
from kvelastic.tier.store import StoredBlock, TierStore
from kvelastic.vmm import get_backend

log = logging.getLogger("kvelastic.daemon")
HASH_SECRET_BYTES = 32


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise KvelasticError("cannot read MemTotal from /proc/meminfo")


def budget_bytes(config: Config, total: int) -> int:
    """``KVELASTIC_MEMORY`` for one device of ``total`` bytes, in whole pages."""
    budget = int(total * config.memory) if isinstance(config.memory, float) else config.memory
    budget -= budget % config.page_size
    if budget < config.page_size:
        raise ConfigError(f"KVELASTIC_MEMORY={config.memory!r} is smaller than one page ({config.page_size} bytes)")
    return budget


def open_devices(config: Config) -> list[Device]:
    """One pool per GPU (each with the same budget rule, known also by its
    UUID), or ``KVELASTIC_HOST_DEVICES`` pools of host memory sharing its budget."""
    from kvelastic.vmm.cuda import CudaBackend

    first = get_backend(config.backend, config.page_size)
    if not isinstance(first, CudaBackend):
        count = config.host_devices
        share = budget_bytes(config, host_memory_bytes()) // count
        if share < config.page_size:
            raise ConfigError(f"KVELASTIC_MEMORY={config.memory!r} split between KVELASTIC_HOST_DEVICES={count} "
                              f"pools is smaller than one page ({config.page_size} bytes) each")
        return [Device(str(i), first, share - share % config.page_size) for i in range(count)]
    devices = []
    for index in range(first.device_count()):
        backend = first if index == first.device else CudaBackend(config.page_size, device=index)
        devices.append(Device(str(index), backend, budget_bytes(config, backend.total_memory()),
                              aliases=(backend.uuid(),)))
    return devices


def prepare_socket_dir(path: str) -> None:
    """Create the socket's folder (owner and group only) and refuse to start
    over a live daemon; a stale socket from a crash is removed. A socket path
    that is a symbolic link was planted by someone: refused too."""
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, mode=0o750, exist_ok=True)
    except FileExistsError:
        pass                    # not a folder (a dangling link...): check_socket_dir says what it is
    check_socket_dir(folder)
    for name in (path, fd_socket_path(path)):
        if os.path.islink(name):
            raise KvelasticError(f"{name} is a symbolic link (to {os.readlink(name)}), not a socket of this daemon: "
                                 f"someone who can write {folder} put it there; remove it (and find out who)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(fd_socket_path(path))
    except OSError:
        pass
    else:
        raise KvelasticError(f"another kvelastic daemon is running on {path}")
    finally:
        probe.close()
    for stale in (path, fd_socket_path(path)):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass


def socket_group(name: str, variable: str = "KVELASTIC_SOCKET_GROUP") -> int:
    """``KVELASTIC_SOCKET_GROUP`` (or ``variable``) as a group id (default: the daemon's own group)."""
    if not name:
        return os.getegid()
    if name.isdigit():
        return int(name)
    import grp

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise KvelasticError(f"{variable}={name!r}: no such group") from None


def check_socket_dir(folder: str) -> None:
    """Refuse a socket folder that someone else could use to squat or delete
    the daemon's sockets: it must be a real folder (a symbolic link can be
    re-pointed by whoever made it, and a predictable /tmp path may have been
    made by anyone), the daemon user's (or root's), and not writable by others."""
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise KvelasticError(f"the socket folder {folder} is a symbolic link (to {os.readlink(folder)}), which whoever "
                             f"made it can re-point at a folder of their own: set KVELASTIC_SOCKET to a path in a "
                             f"real folder (e.g. {os.path.realpath(folder)} if that one is yours), or remove the link")
    if not stat.S_ISDIR(st.st_mode):
        raise KvelasticError(f"the socket folder {folder} is not a folder: remove it, or set KVELASTIC_SOCKET "
                             "to a path in a folder you own")
    if st.st_uid not in (os.geteuid(), 0):
        raise KvelasticError(f"the socket folder {folder} belongs to uid {st.st_uid}, not to this user "
                             f"(uid {os.geteuid()}): remove it, or set KVELASTIC_SOCKET to a folder you own")
    if st.st_mode & 0o002:
        raise KvelasticError(f"the socket folder {folder} is writable by every user (mode {st.st_mode & 0o7777:o}): "
                             f"run 'chmod o-w {folder}', or set KVELASTIC_SOCKET to a folder of your own")


def load_hash_secret(socket_path: str) -> bytes:
    """The key of the namespaces' hash seeds, kept beside the socket (mode
    0600) so that a restarted daemon gives engines the seeds their caches were
    hashed with. Made on first start; a file anyone else can read is refused."""
    path = socket_path + ".hash-secret"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise KvelasticError(f"{path} is not a file (a symbolic link?), and it is never followed: it must be a "
                                 f"file of this user with mode 0600 (it holds the key of the prefix-cache hash "
                                 f"seeds): remove it, a new one is made at start") from None
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise KvelasticError(f"{path} must belong to this user with mode 0600 (it holds the key of the "
                                 f"prefix-cache hash seeds): remove it, a new one is made at start") from None
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            secret = f.read()
        if len(secret) != HASH_SECRET_BYTES:
            raise KvelasticError(f"{path} holds {len(secret)} bytes, not {HASH_SECRET_BYTES}: remove it, "
                                 "a new one is made at start") from None
        return secret
    secret = secrets.token_bytes(HASH_SECRET_BYTES)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret


def raise_fd_limit() -> None:
    """The daemon holds one descriptor per page (12,000 for a 24 GiB pool)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def open_tier(config: Config, now: float, key: bytes) -> tuple[TierIndex, TierStore, list[StoredBlock]] | None:
    """The node's tier, None when none is configured: on disk
    (``KVELASTIC_TIER_DIR``), its index rebuilt from what the directory
    holds; in host memory (``KVELASTIC_TIER_HOST_SIZE``), empty; or both,
    host memory above the disk (blocks enter above and move down). The
    directory must be the daemon's alone: blocks found there are served to
    engines as their KV, so one that another user could write to, or a
    symbolic link (whoever made it could re-point it), is refused. The store
    keeps the folder it opened here whatever its path names later, and
    ``key`` (the node's hash secret) proves each file it reads is this
    daemon's."""
    host = config.tier_host_size
    if host and not config.tier_dir:
        log.info("tier in host memory: budget %d MiB, empty at start", host >> 20)
        return TierIndex(host, media=("host",)), open_store("host"), []
    if not config.tier_dir:
        return None
    where = f"KVELASTIC_TIER_DIR={config.tier_dir!r}"
    try:
        store = open_store("host+disk" if host else "disk", config.tier_dir, key=key)
    except UntrustedTier as exc:
        raise ConfigError(f"{where}: {exc.why}") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot use it ({exc.strerror or exc})") from None
    try:
        index = TierIndex(host, media=("host", "disk"), lower_bytes=config.tier_size) if host else \
            TierIndex(config.tier_size)
        found = rebuild(index, store, now)
    except OSError as exc:
        store.close()
        raise ConfigError(f"{where}: cannot use it ({exc.strerror or exc})") from None
    dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(found.dropped.items())) or "none"
    log.info("tier %s: %d block(s) in %d MiB of %d MiB rebuilt from disk; files dropped: %s%s", config.tier_dir,
             sum(index.namespaces().values()), index.bytes_used >> 20, config.tier_size >> 20, dropped,
             f"; host memory above it: budget {host >> 20} MiB" if host else "")
    return index, store, found.entries


def main() -> int:
    config = configured("kvelastic daemon")
    if config is None:
        return 2
    raise_fd_limit()
    try:
        devices = open_devices(config)
        prepare_socket_dir(config.socket)
        kv_events = ((config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_buffer)
                     if config.kv_events_endpoint else None)
        timing = Timing(ack_timeout=config.ack_timeout or p.ACK_TIMEOUT,
                        grow_timeout=config.grow_timeout or p.GROW_TIMEOUT,
                        idle_grace=config.idle_grace, hold_down=config.hold_down,
                        orphan_ttl=config.orphan_cache_ttl)
        group = socket_group(config.socket_group)
        operators = socket_group(config.operator_group, "KVELASTIC_OPERATOR_GROUP") if config.operator_group else None
        hash_secret = load_hash_secret(config.socket)     # before the tier: it keys the tier's files too
        tier, tier_store, tier_found = open_tier(config, time.monotonic(), hash_secret) or (None, None, [])
        keeper = PageKeeper.open(config.socket, config.keeper, config.keeper_linger)
        daemon = Daemon(devices, config.socket, kv_events=kv_events, timing=timing, access=Access(group=group),
                        tenancy=Tenancy(operator_group=operators),
                        max_engines=config.max_engines, hash_secret=hash_secret,
                        tier=tier, tier_store=tier_store, tier_found=tier_found, keeper=keeper,
                        tier_events=tier_stream(config))
        if keeper is not None:
            daemon.take_back(boot_id())
    except KvelasticError as exc:
        print(f"kvelastic daemon: {exc}", file=sys.stderr)
        return 1
    events = daemon.events.ipc_paths() if daemon.events else []
    for path in (config.socket, fd_socket_path(config.socket), *events):
        os.chmod(path, 0o660)   # owner and the kvelastic group only
        if group != os.getegid():
            os.chown(path, -1, group)
    if config.metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(config.metrics_port, addr=config.metrics_addr, registry=daemon.metrics.registry)
        except OSError as exc:
            print(f"kvelastic daemon: cannot serve metrics on {config.metrics_addr}:{config.metrics_port} "
                  f"({exc}); set KVELASTIC_METRICS_PORT", file=sys.stderr)
            daemon.close()
            return 1
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    log.info("kvelastic daemon ready: %s backend, %s, pages of %d KiB, socket %s, metrics %s, "
             "KV events %s", devices[0].backend.name,
             ", ".join(f"device {d.name} budget {d.budget_bytes >> 20} MiB" for d in devices),
             config.page_size >> 10, config.socket,
             f"{config.metrics_addr}:{config.metrics_port}" if config.metrics_port else "off",
             config.kv_events_endpoint or "off")
    sd_notify("READY=1")
    try:
        daemon.serve(lambda: bool(stopping))
    finally:
        sd_notify("STOPPING=1")
        log.info("kvelastic daemon stopping")
        daemon.close()
        if keeper is not None and keeper.started is not None and keeper.started.poll() is None:
            log.info("the keeper (pid %d) holds this daemon's pages %g s for the next one (KVELASTIC_KEEPER_LINGER)",
                     keeper.started.pid, config.keeper_linger)
        if tier_store is not None:
            tier_store.close()      # after the writer stopped (daemon.close)
    return 0
