"""The tier folder through a link (security audit, high): a real daemon with
``KVELASTIC_TIER_DIR``, against files and links another uid makes.

The finding: the daemon checked the folder with ``os.stat`` (through a link)
and the store named every file by path again, so a link another user made,
and later re-pointed, let that user read a tenant's blocks and have its
engine load bytes of the user's own (a CRC-32 is no defence against a
writer). Now the folder is opened once (a link refused), every file named
relative to that descriptor, and each file's tags are keyed with the node's
hash secret. Mallory is uid 6002 (``tests/daemon/test_tenants.py``); the
tests run as root, which is what lets them start her processes.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import struct
import subprocess
import tempfile
import zlib

import pytest

from kvelastic import protocol as p
from kvelastic.daemon.main import load_hash_secret
from kvelastic.daemon.tiering import CHUNK
from kvelastic.tier.disk import DiskStore
from tests.daemon.engines import EngineProcess
from tests.daemon.hostile import tenant_script
from tests.daemon_proc import DaemonProcess, wait_for

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run processes as other users"),
    pytest.mark.skipif(__import__("tests.backend").backend.TEST_BACKEND != "host",
                       reason="demotion source A reads memfd pages: host backend"),
]

MALLORY = (6002, 4242)
ROOT = pathlib.Path(__file__).resolve().parents[2]
KEEP = {"grace": 60, "journal_interval": 3600}
BLOCK = (2 << 20) * 2 // 4        # ppw 2 (two layer regions of a 2 MiB page), 4 blocks a slab
FORGED = 0xEE                     # every byte of what Mallory wants engines to load


@pytest.fixture
def shared_dir():
    """A folder every user may write to (as /tmp is): where a link can be put."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvelastic-trust-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)       # links inside are removed, never followed


def as_mallory(code: str) -> str:
    """Run ``code`` as uid 6002 (nothing but builtins and ``os`` after it became her: the interpreter's
    own files may be unreadable to her); its standard output."""
    out = subprocess.run(tenant_script(MALLORY, code, ROOT), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def crc_block(namespace: str, key: bytes, payload: bytes, cost: float = 1.0) -> bytes:
    """A well-formed block file of version 2, its CRC-32s right: what anyone could write, and what a
    daemon without keyed tags served."""
    ns = namespace.encode()
    head = struct.pack("<4sHHHHHHQdI", b"KVTB", 2, 0, len(ns), len(key), 0, 0, len(payload), cost,
                       zlib.crc32(payload)) + ns + key
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def fetch(engine: EngineProcess, lease: int, block: int) -> bytes | None:
    """A block's bytes, chunk by chunk; None when the daemon found it bad."""
    data, size = b"", None
    while size is None or len(data) < size:
        reply = engine.send(p.TierFetch(engine_id=engine.engine_id, lease=lease, block=block, offset=len(data)))
        assert isinstance(reply, p.TierData), reply
        if reply.size < 0:
            return None
        assert len(reply.data) <= CHUNK
        data, size = data + reply.data, reply.size
    return data


def kept_then_demoted(daemon: DaemonProcess, engine: EngineProcess, prefix: str, value: int, blocks: int) -> None:
    """``engine`` caches 4 blocks under ``prefix`` (``value`` written in its pages) and is killed: its
    kept cache expires into the tier, until ``blocks`` blocks were demoted in all."""
    assert engine.do("ensure", n=4)["ok"]
    step = engine.do("step")["step"]
    assert engine.do("alloc", n=4)["ok"]
    engine.do("cache", prefix=prefix)
    engine.do("seal")
    engine.do("write", value=value)
    engine.do("end_step", n=step)
    engine.do("free")
    engine.do("flush")
    engine.kill()
    wait_for(lambda: (t := daemon.status()["tier"])["counters"]["demotions"] == blocks and t["writing"] == 0,
             timeout=15, what=f"{prefix}'s kept cache demoted and written")


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


# ------------------------------------------------------------------ (1)
def test_a_tier_folder_that_is_a_link_another_user_made_is_refused(tmp_path, shared_dir):
    # The link points at a good folder (root's, 0700): through the link, every check of the
    # folder passed, and whoever made the link could re-point it at any time.
    real = shared_dir / "real"
    real.mkdir(mode=0o700)
    link = shared_dir / "tier"
    as_mallory(f"os.symlink({str(real)!r}, {str(link)!r}); print('linked')")
    assert link.is_symlink() and os.lstat(link).st_uid == MALLORY[0]
    daemon = DaemonProcess(tmp_path, KVELASTIC_TIER_DIR=str(link))
    with pytest.raises(RuntimeError, match="is a symbolic link") as failed:
        daemon.start()
    assert f"KVELASTIC_TIER_DIR={str(link)!r}" in str(failed.value) and "re-point" in str(failed.value)
    assert os.listdir(real) == []                    # nothing made or scanned through it


# ------------------------------------------------------------------ (2)
def test_a_folder_swapped_for_a_link_under_a_running_daemon_changes_nothing(tmp_path, shared_dir):
    """Mallory renames the daemon's tier folder away (its parent is writable by all, without the
    sticky bit) and puts at its path a link to a folder of her own, holding well-formed blocks of
    her own under the names of the daemon's. The daemon keeps reading and writing its own
    folder: an engine loads the bytes its namespace's engine wrote, never hers, and her folder
    receives no file."""
    shared_dir.chmod(0o777)
    path, moved, hers = shared_dir / "tier", shared_dir / "tier.moved", shared_dir / "mallory"
    path.mkdir(mode=0o700)
    daemon = DaemonProcess(tmp_path, memory="8MiB", KVELASTIC_TIER_DIR=str(path), KVELASTIC_TIER_SIZE="64MiB",
                           KVELASTIC_ORPHAN_CACHE_TTL="1s")
    secret = load_hash_secret(daemon.socket)
    daemon.start()
    started: list[EngineProcess] = []

    def engine(engine_id: str, namespace: str) -> EngineProcess:
        e = EngineProcess(daemon.socket, engine_id, namespace=namespace, ppw=2, bps=4, **KEEP)
        started.append(e)
        return e

    try:
        kept_then_demoted(daemon, engine("a", "llama-1"), "sys", 7, blocks=4)
        real = {e.slot: e for e in DiskStore(path, key=secret).scan().entries}
        assert sorted(e.key for e in real.values()) == keys("sys", 4)
        # Her blocks, forged as root here (she may not read the interpreter's modules once she is
        # herself) and copied by her: each of the daemon's blocks, and the slots it writes next.
        forged = shared_dir / "forged"
        forged.mkdir(mode=0o755)
        for slot in range(16):
            entry = real.get(slot)
            ns, key = (entry.namespace, entry.key) if entry else ("llama-2", b"late-%d" % (slot - 4))
            (forged / f"{slot:016x}.kvb").write_bytes(crc_block(ns, key, bytes([FORGED]) * BLOCK))
            (forged / f"{slot:016x}.kvb").chmod(0o644)
        as_mallory(f"""
path, moved, hers, forged = {str(path)!r}, {str(moved)!r}, {str(hers)!r}, {str(forged)!r}
os.rename(path, moved)
os.mkdir(hers, 0o755)
for name in os.listdir(forged):
    with open(os.path.join(forged, name), "rb") as src, open(os.path.join(hers, name), "wb") as dst:
        dst.write(src.read())
os.symlink(hers, path)
print("swapped")
""")
        assert path.is_symlink() and os.readlink(path) == str(hers)
        planted = snapshot(hers)

        b = engine("b", "llama-1")
        pinned = b.send(p.TierLookup(engine_id="b", keys=keys("sys", 4)))
        assert isinstance(pinned, p.TierPinned) and pinned.nbytes == [BLOCK] * 4
        blocks = [fetch(b, pinned.lease, i) for i in range(4)]
        assert all(block is not None and FORGED not in block for block in blocks)      # a's bytes, never hers
        assert sum(block[0] == 7 for block in blocks if block) == 1
        assert daemon.status()["tier"]["counters"]["promotions"] == 4

        kept_then_demoted(daemon, engine("c", "llama-2"), "late", 9, blocks=8)     # written after the swap
        assert len([n for n in os.listdir(moved) if n.endswith(".kvb")]) == 8         # in the daemon's folder
        assert snapshot(hers) == planted                                               # hers: untouched
    finally:
        for e in started:
            e.close()
        daemon.stop()


# ------------------------------------------------------------------ (3)
def test_files_planted_in_the_folder_are_never_served_and_dropped_at_start(tmp_path, shared_dir):
    """Whoever may write the folder (root, here) puts there well-formed blocks the daemon's key did
    not tag: of version 2 with their CRC-32s right, of version 3 without a key or under another,
    a link named like a block to a block of the daemon's own key, a FIFO. The daemon drops each
    at start, counted, and serves only its own; a genuine block's file replaced by a forged one
    after the start is refused when an engine loads it, never served."""
    folder = tmp_path / "tier"
    daemon = DaemonProcess(tmp_path, memory="8MiB", KVELASTIC_TIER_DIR=str(folder), KVELASTIC_TIER_SIZE="64MiB")
    secret = load_hash_secret(daemon.socket)
    ours = DiskStore(folder, key=secret)
    ours.write(0, "llama-1", b"real-0", b"\x01" * BLOCK, cost=1.0)
    forged = bytes([FORGED]) * BLOCK
    ours.path(1).write_bytes(crc_block("llama-1", b"real-1", forged))
    DiskStore(folder, key=None).write(2, "llama-1", b"real-2", forged, cost=1.0)
    DiskStore(folder, key=b"a guess" * 5).write(3, "llama-1", b"real-3", forged, cost=1.0)
    elsewhere = DiskStore(shared_dir / "elsewhere", key=secret)            # a block of the daemon's own key
    elsewhere.write(4, "llama-1", b"real-4", forged, cost=1.0)
    ours.path(4).symlink_to(elsewhere.path(4))
    os.mkfifo(ours.path(5))
    daemon.start()
    b = None
    try:
        tier = daemon.status()["tier"]
        assert tier["namespaces"] == {"llama-1": 1} and tier["counters"]["restored"] == 1
        assert "files dropped: 1 checksum, 2 not_a_file, 2 unkeyed" in daemon.log(), daemon.log()
        assert tier["counters"]["failures_checksum"] == 1     # unkeyed and not-a-file: never blocks of ours
        assert os.listdir(folder) == [ours.path(0).name]
        assert elsewhere.read(4, "llama-1", b"real-4") == forged          # the link went, its target stays

        ours.path(0).write_bytes(crc_block("llama-1", b"real-0", forged))   # swapped under the index
        b = EngineProcess(daemon.socket, "b", namespace="llama-1", ppw=2, bps=4, **KEEP)
        pinned = b.send(p.TierLookup(engine_id="b", keys=[b"real-0"]))
        assert isinstance(pinned, p.TierPinned) and pinned.nbytes == [BLOCK]
        assert fetch(b, pinned.lease, 0) is None                           # refused, not served (its lease ends)
        tier = daemon.status()["tier"]
        assert tier["blocks"] == 0 and tier["counters"]["failures_checksum"] == 2
        wait_for(lambda: os.listdir(folder) == [], what="the forged file deleted")
    finally:
        if b is not None:
            b.close()
        daemon.stop()
