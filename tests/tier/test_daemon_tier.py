"""The node's tier in a real daemon process (``KVELASTIC_TIER_DIR``): rebuilt
from disk at start with what fails its check dropped and counted, shown by
``status`` and ``/metrics``, reached by ``kvelastic invalidate``, kept across
a restart, and a directory another user could write to refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvelastic import protocol as p
from kvelastic.daemon.main import load_hash_secret
from kvelastic.tier.disk import DiskStore
from tests.daemon_proc import DaemonProcess, short_dir

BLOCK = 64 << 10


def seeded(folder, key: bytes) -> tuple[DiskStore, dict[str, list[int]]]:
    """A tier directory as a daemon left it: namespace a's prefix of five
    blocks and b's of three, then b's second block cut short, its third's
    header flipped, and an unfinished write; under the daemon's ``key``."""
    store = DiskStore(folder, key=key)
    slots: dict[str, list[int]] = {"model-a": [], "model-b": []}
    slot = 0
    for ns, n in (("model-a", 5), ("model-b", 3)):
        parent = None
        for i in range(n):
            key = f"{ns}-{i}".encode()
            store.write(slot, ns, key, bytes([slot]) * BLOCK, cost=float(i + 1), parent=parent)
            slots[ns].append(slot)
            parent, slot = key, slot + 1
    torn, flipped = store.path(slots["model-b"][1]), store.path(slots["model-b"][2])
    torn.write_bytes(torn.read_bytes()[:-100])
    data = bytearray(flipped.read_bytes())
    data[40] ^= 0x10                                         # inside the header: its checksum fails
    flipped.write_bytes(bytes(data))
    (folder / f".{store.path(99).name}.tmp").write_bytes(b"half a block")
    return store, slots


def kvelastic(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvelastic", *args], env=daemon.env, capture_output=True,
                          text=True, timeout=30)


def metric(text: str, series: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " "))


def test_the_tier_is_rebuilt_shown_invalidated_and_kept_across_a_restart(tmp_path):
    folder = short_dir(tmp_path) / "tier"
    daemon = DaemonProcess(tmp_path, KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="1MiB")
    store, slots = seeded(folder, load_hash_secret(daemon.socket))     # the key it finds beside its socket
    daemon.start()
    try:
        tier = daemon.status()["tier"]
        assert tier["namespaces"] == {"model-a": 5, "model-b": 1}
        assert tier["blocks"] == 6 and tier["bytes"] == 6 * BLOCK and tier["budget_bytes"] == 1 << 20
        assert tier["counters"]["failures_torn"] == 2 and tier["counters"]["failures_checksum"] == 1
        assert tier["counters"]["restored"] == 6
        assert sorted(os.listdir(folder)) == sorted(store.path(s).name for s in [*slots["model-a"],
                                                                                 slots["model-b"][0]])
        assert "6 block(s) in 0 MiB of 1 MiB rebuilt from disk; files dropped: 1 checksum, 2 torn" in daemon.log()
        text = daemon.metrics()
        assert metric(text, 'kvelastic_tier_blocks{namespace="model-a"}') == 5
        assert metric(text, 'kvelastic_tier_failures_total{reason="torn"}') == 2
        assert metric(text, "kvelastic_tier_bytes") == 6 * BLOCK
        shown = kvelastic(daemon, "status").stdout
        assert "tier         disk: 6 block(s), 384.0 KiB of 1.0 MiB, 2 namespace(s)" in shown

        before = daemon.status()
        unknown = kvelastic(daemon, "invalidate", "model-c")
        assert unknown.returncode != 0 and "model-c" in unknown.stderr
        assert daemon.status()["tier"] == before["tier"]                # a refusal changes nothing

        done = kvelastic(daemon, "invalidate", "model-a")
        assert done.returncode == 0 and "5 block(s) of the tier dropped" in done.stdout, done.stdout + done.stderr
        tier = daemon.status()["tier"]
        assert tier["namespaces"] == {"model-b": 1} and tier["counters"]["evictions_invalidate"] == 5
        assert os.listdir(folder) == [store.path(slots["model-b"][0]).name]
        assert "model-a: 5 block(s) of the tier invalidated" in daemon.log()
    finally:
        daemon.stop()

    again = DaemonProcess(tmp_path, KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="1MiB").start()
    try:
        assert again.status()["tier"]["namespaces"] == {"model-b": 1}   # what was on disk, and only that
        reply = again.request(p.Invalidate(target="model-b"))
        assert isinstance(reply, p.Invalidated) and reply.tier_blocks == 1 and reply.engines == 0
        assert os.listdir(folder) == []
    finally:
        again.stop()


def test_a_smaller_budget_after_a_restart_drops_the_least_valuable_blocks(tmp_path):
    folder = short_dir(tmp_path) / "tier"
    daemon = DaemonProcess(tmp_path, KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE=str(3 * BLOCK))
    store, slots = seeded(folder, load_hash_secret(daemon.socket))
    daemon.start()
    try:
        tier = daemon.status()["tier"]
        assert tier["blocks"] == 3 and tier["counters"]["evictions_budget"] == 3
        # Leaves first, then by value (cost per byte): b's lone block (cost 1) and a's tail (costs 5, 4)
        # go; a's first three blocks, a prefix that can still be found, stay.
        assert tier["namespaces"] == {"model-a": 3}
        assert sorted(os.listdir(folder)) == sorted(store.path(s).name for s in slots["model-a"][:3])
    finally:
        daemon.stop()


@pytest.mark.parametrize("mode", [0o777, 0o720])
def test_a_tier_directory_others_can_write_is_refused(tmp_path, mode):
    folder = short_dir(tmp_path) / "tier"
    folder.mkdir()
    folder.chmod(mode)
    daemon = DaemonProcess(tmp_path, KVELASTIC_TIER_DIR=str(folder))
    with pytest.raises(RuntimeError, match="writable by no one else") as failed:
        daemon.start()
    assert f"KVELASTIC_TIER_DIR={str(folder)!r}" in str(failed.value) and "chmod 700" in str(failed.value)


def test_a_relative_tier_directory_is_a_configuration_error(tmp_path):
    daemon = DaemonProcess(tmp_path, KVELASTIC_TIER_DIR="tier")
    with pytest.raises(RuntimeError, match="KVELASTIC_TIER_DIR='tier': expected an absolute directory path"):
        daemon.start()
