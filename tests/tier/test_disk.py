"""DiskStore with real files in tmp_path: round trips, torn and corrupted
files detected by ``read`` and dropped by ``scan``, a full disk that leaves
no file, the index rebuilt after a restart; and what the store trusts: its
folder opened once (a symbolic link refused, a path re-pointed later
ignored), only files its key proves (no CRC-only or unkeyed file, none under
another key or another slot's name), only regular files (no link followed,
no FIFO opened to hang on), temporary files never through a link."""

import errno
import os
import stat

import pytest

from kvelastic.tier.disk import DiskStore, NotABlockFile, UnkeyedBlock, UntrustedTierDir
from kvelastic.tier.errors import (
    ChecksumMismatch,
    IdentityMismatch,
    TierDiskFull,
    TierReadError,
    TierWriteError,
    TornBlock,
)
from kvelastic.tier.index import TierIndex
from kvelastic.tier.restart import rebuild

NS = "llama-3f2a"
KEY = bytes(range(32))          # the node's hash secret, as the daemon passes it


def keyed(directory, key: bytes | None = KEY, **kw) -> DiskStore:
    """A store as the daemon opens it: with its key."""
    return DiskStore(directory, key=key, **kw)


def payload(n=4096, seed=1):
    return bytes((i * 31 + seed) % 251 for i in range(n))


def files(store):
    return sorted(p.name for p in store.directory.iterdir())


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


# ------------------------------------------------------------ round trip
def test_round_trip_keeps_bytes_and_identity(tmp_path):
    store = keyed(tmp_path / "tier")
    store.write(5, NS, b"key-5", payload(), cost=2.5, parent=b"key-4")
    store.write(6, NS, b"key-6", memoryview(payload(100, seed=2)), cost=1.0)
    assert store.read(5, NS, b"key-5") == payload()
    assert store.read(6) == payload(100, seed=2)
    h = store.header(5)
    assert (h.slot, h.namespace, h.key, h.parent, h.nbytes, h.cost) == (5, NS, b"key-5", b"key-4", 4096, 2.5)
    assert store.header(6).parent is None
    assert files(store) == ["0000000000000005.kvb", "0000000000000006.kvb"]    # no temporary file left
    assert stat.S_IMODE(store.path(5).stat().st_mode) == 0o600
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700


def test_a_label_is_kept(tmp_path):
    store = keyed(tmp_path)
    store.write(3, NS, b"key", payload(), cost=2.0, label=b"the engine's event")
    assert store.header(3).label == b"the engine's event" and store.scan().entries[0].label == b"the engine's event"


def crc_file(version: int) -> bytes:
    """A well-formed block of a version before tags were keyed: its CRC-32s right, as anyone can make them."""
    import struct
    import zlib

    pad = "2x" if version == 1 else "H"
    fields = (b"KVTB", version, 0, len(NS), 3, 0) + (() if version == 1 else (0,)) + (4096, 2.0, zlib.crc32(payload()))
    head = struct.pack(f"<4sHHHHH{pad}QdI", *fields) + NS.encode() + b"key"
    return head + struct.pack("<I", zlib.crc32(head)) + payload()


@pytest.mark.parametrize("key", [KEY, None])
def test_files_of_versions_1_and_2_are_never_served_and_dropped_as_unkeyed(tmp_path, key):
    store = keyed(tmp_path, key=key)
    store.write(1, NS, b"ours", payload(), cost=1.0)
    store.path(4).write_bytes(crc_file(1))
    store.path(5).write_bytes(crc_file(2))
    for slot in (4, 5):
        with pytest.raises(UnkeyedBlock) as exc:
            store.read(slot, NS, b"key")
        assert exc.value.reason == "checksum"           # to the index, met by a read: a failed check
    result = store.scan()
    assert [e.slot for e in result.entries] == [1] and result.dropped == {"unkeyed": 2}
    assert files(store) == ["0000000000000001.kvb"]


def test_only_files_of_the_stores_own_key_are_served(tmp_path):
    ours, other, unkeyed = keyed(tmp_path), keyed(tmp_path, key=b"k" * 32), keyed(tmp_path, key=None)
    ours.write(1, NS, b"ours", payload(), cost=1.0)
    other.write(2, NS, b"other key", payload(), cost=1.0)      # another node's secret, or a forger's guess
    unkeyed.write(3, NS, b"no key", payload(), cost=1.0)       # tags anyone can compute
    assert ours.read(1, NS, b"ours") == payload()
    with pytest.raises(ChecksumMismatch):
        ours.read(2)
    with pytest.raises(UnkeyedBlock):
        ours.read(3)
    with pytest.raises(UnkeyedBlock):                           # a store without the key cannot check ours
        unkeyed.read(1)
    result = ours.scan()
    assert [e.slot for e in result.entries] == [1] and result.dropped == {"checksum": 1, "unkeyed": 1}


def test_a_block_copied_under_another_slots_name_is_refused(tmp_path):
    # The header's tag covers the slot: a file of the store's own key, renamed, answers for no other slot.
    store = keyed(tmp_path)
    store.write(1, NS, b"k", payload(), cost=1.0)
    store.path(2).write_bytes(store.path(1).read_bytes())
    with pytest.raises(ChecksumMismatch):
        store.read(2)
    assert [e.slot for e in store.scan().entries] == [1]


def test_short_writes_are_continued(tmp_path, monkeypatch):
    # The kernel may write less than asked: a fake os.write that takes 7 bytes at a time.
    store = keyed(tmp_path)
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    store.write(1, NS, b"k", payload(1000), cost=1.0)
    monkeypatch.undo()
    assert store.read(1, NS, b"k") == payload(1000)


def test_a_read_of_another_block_than_asked_is_refused(tmp_path):
    store = keyed(tmp_path)
    store.write(1, NS, b"k", payload(), cost=1.0)
    with pytest.raises(IdentityMismatch):
        store.read(1, NS, b"other")
    with pytest.raises(IdentityMismatch):
        store.read(1, "other-ns", b"k")


def test_a_missing_file_is_a_read_error(tmp_path):
    with pytest.raises(TierReadError) as exc:
        keyed(tmp_path).read(3)
    assert exc.value.reason == "io"


# ----------------------------------------------------- torn and corrupted
@pytest.mark.parametrize("cut", [0, 10, 60, 4000])
def test_a_truncated_file_is_torn_and_dropped_by_scan(tmp_path, cut):
    store = keyed(tmp_path)
    store.write(1, NS, b"good", payload(), cost=1.0)
    store.write(2, NS, b"torn", payload(), cost=1.0)
    os.truncate(store.path(2), cut)         # inside the fixed header, the variable header, the payload
    with pytest.raises(TornBlock):
        store.read(2)
    result = store.scan()
    assert [e.key for e in result.entries] == [b"good"]
    assert result.dropped == {"torn": 1}
    assert files(store) == ["0000000000000001.kvb"]


def test_a_flipped_payload_byte_fails_read_and_a_verifying_scan(tmp_path):
    store = keyed(tmp_path)
    store.write(1, NS, b"k", payload(), cost=1.0)
    flip(store.path(1), os.path.getsize(store.path(1)) - 100)
    with pytest.raises(ChecksumMismatch):
        store.read(1)
    assert [e.slot for e in store.scan().entries] == [1]       # headers only: kept, and read() refuses it
    result = store.scan(verify_payloads=True)
    assert result.entries == [] and result.dropped == {"checksum": 1} and files(store) == []


# magic, version, flags, lengths, the payload's tag, the namespace, the key, the header's tag
@pytest.mark.parametrize("offset", [0, 5, 6, 10, 40, 66, 75, 80])
def test_a_flipped_header_byte_is_never_read_as_another_block(tmp_path, offset):
    store = keyed(tmp_path)
    store.write(1, NS, b"key", payload(), cost=1.0)
    flip(store.path(1), offset)
    with pytest.raises((ChecksumMismatch, TornBlock)):
        store.read(1)
    result = store.scan()
    assert result.entries == [] and sum(result.dropped.values()) == 1 and files(store) == []


def test_scan_deletes_unfinished_writes_and_leaves_other_files_alone(tmp_path):
    store = keyed(tmp_path)
    store.write(1, NS, b"k", payload(), cost=1.0)
    (tmp_path / ".0000000000000002.kvb.tmp").write_bytes(b"half a block")
    (tmp_path / "README").write_text("not ours")
    result = store.scan()
    assert [e.slot for e in result.entries] == [1] and result.dropped == {"torn": 1}
    assert files(store) == ["0000000000000001.kvb", "README"]


# -------------------------------------------------------------- disk full
@pytest.mark.parametrize(("code", "error", "reason"), [
    (errno.ENOSPC, TierDiskFull, "disk_full"),
    (errno.EDQUOT, TierDiskFull, "disk_full"),
    (errno.EIO, TierWriteError, "io"),
])
def test_a_failed_write_raises_typed_and_leaves_no_file(tmp_path, monkeypatch, code, error, reason):
    # No small tmpfs here to fill: a fake os.write stands in for the one peer,
    # the file system, writing the header and then failing with ``code``.
    store = keyed(tmp_path)
    store.write(1, NS, b"old", payload(), cost=1.0)
    real_write, calls = os.write, []

    def failing_write(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(error) as exc:
        store.write(2, NS, b"new", payload(), cost=1.0)
    monkeypatch.undo()
    assert exc.value.reason == reason and len(calls) == 2
    assert files(store) == ["0000000000000001.kvb"]                 # neither the block nor its temporary file
    assert store.read(1, NS, b"old") == payload()


def test_a_failed_rewrite_of_a_slot_keeps_no_half_block(tmp_path, monkeypatch):
    store = keyed(tmp_path)
    monkeypatch.setattr(os, "replace", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(TierDiskFull):
        store.write(1, NS, b"k", payload(), cost=1.0)
    assert files(store) == []


# ---------------------------------------------------------------- restart
def test_rebuild_restores_what_checks_and_deletes_the_rest(tmp_path):
    store = keyed(tmp_path)
    for slot, key in enumerate([b"a", b"b", b"c", b"d"]):
        store.write(slot, NS, key, payload(100), cost=1.0, parent=None if slot == 0 else bytes([key[0] - 1]))
    store.write(4, NS, b"a", payload(100), cost=1.0)     # a second file of key "a": dropped
    os.truncate(store.path(2), 50)                      # torn: dropped
    index = TierIndex(1000)
    result = rebuild(index, store, now=0.0)
    index.check()
    assert result.dropped == {"torn": 1, "not_restored": 1}
    assert index.lookup(NS, [b"a", b"b", b"c", b"d"], 0.0) == [0, 1]
    assert index.reserve(NS, b"e", 100, 1.0, 0.0) == 5           # after every slot on disk
    assert files(store) == ["0000000000000000.kvb", "0000000000000001.kvb", "0000000000000003.kvb"]


def test_rebuild_under_a_smaller_budget_keeps_the_most_valuable(tmp_path):
    store = keyed(tmp_path)
    store.write(0, NS, b"cheap", payload(100), cost=1.0)
    store.write(1, NS, b"dear", payload(100), cost=50.0)
    store.write(2, NS, b"mid", payload(100), cost=5.0)
    index = TierIndex(200)
    rebuild(index, store, now=0.0)
    assert index.stats.evictions["budget"] == 1
    assert files(store) == ["0000000000000001.kvb", "0000000000000002.kvb"]
    index.check()


# ------------------------------------------------------- the folder's trust
def test_a_symbolic_link_as_the_folder_is_refused_and_nothing_made_through_it(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UntrustedTierDir, match="is a symbolic link .* re-point"):
        keyed(tmp_path / "link")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UntrustedTierDir, match="is a symbolic link"):
        keyed(tmp_path / "dangling")
    assert not (tmp_path / "nowhere").exists()          # not made through the link either
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(UntrustedTierDir, match="is not a folder"):
        keyed(tmp_path / "file")


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o777])
def test_a_folder_others_can_write_is_refused(tmp_path, mode):
    folder = tmp_path / "tier"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(UntrustedTierDir, match="writable by no one else .* chmod 700"):
        keyed(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_folder_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    os.chown(folder, 6002, 4242)
    with pytest.raises(UntrustedTierDir, match=r"owned by the daemon's user .*\(it is uid 6002"):
        keyed(folder)


def test_a_missing_folder_is_made_0700(tmp_path):
    store = keyed(tmp_path / "a" / "tier")
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "tier").st_mode) == 0o700 and store.scan().entries == []


def test_the_store_keeps_its_folder_when_the_path_is_re_pointed(tmp_path):
    # The attack: the folder renamed away and a link to another folder put at its path. The other
    # folder holds a block planted for slot 1, even one under the store's own key: never read.
    path, moved, other = tmp_path / "tier", tmp_path / "moved", tmp_path / "other"
    store = keyed(path)
    store.write(1, NS, b"real", payload(), cost=1.0)
    keyed(other).write(1, NS, b"real", payload(seed=9), cost=1.0)
    planted = sorted(os.listdir(other))
    path.rename(moved)
    path.symlink_to(other)
    store.write(2, NS, b"after", payload(100), cost=1.0)
    assert store.read(1, NS, b"real") == payload()                    # the real folder's, not the planted one
    assert [e.slot for e in store.scan().entries] == [1, 2]
    store.delete(1)
    assert sorted(os.listdir(moved)) == ["0000000000000002.kvb"]       # written, deleted where it always was
    assert sorted(os.listdir(other)) == planted                         # the other folder: untouched
    assert keyed(other).read(1, NS, b"real") == payload(seed=9)


# ------------------------------------------------------------ the files' trust
def test_a_symbolic_link_at_a_blocks_name_is_never_followed(tmp_path):
    elsewhere = keyed(tmp_path / "elsewhere")
    elsewhere.write(3, NS, b"k", payload(), cost=1.0)                  # a valid block of the same key
    store = keyed(tmp_path / "tier")
    store.path(3).symlink_to(elsewhere.path(3))
    with pytest.raises(NotABlockFile):
        store.read(3, NS, b"k")
    with pytest.raises(NotABlockFile):
        store.header(3)
    result = store.scan()
    assert result.entries == [] and result.dropped == {"not_a_file": 1} and files(store) == []
    assert elsewhere.read(3, NS, b"k") == payload()                    # the link went, not its target


def test_a_fifo_or_a_folder_at_a_blocks_name_is_refused_without_hanging(tmp_path):
    store = keyed(tmp_path)
    os.mkfifo(store.path(1))            # opened for reading without O_NONBLOCK, it would wait for a writer
    store.path(2).mkdir()
    for slot in (1, 2):
        with pytest.raises(NotABlockFile):
            store.read(slot)
    result = store.scan(verify_payloads=True)
    assert result.entries == [] and result.dropped == {"not_a_file": 2}
    assert files(store) == ["0000000000000002.kvb"]                    # a folder is only counted


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_link_planted_at_the_temporary_name_is_never_written_through(tmp_path, target_exists):
    store = keyed(tmp_path / "tier")
    victim = tmp_path / "victim"
    if target_exists:
        victim.write_bytes(b"someone's file")
    (store.directory / f".{store.path(1).name}.tmp").symlink_to(victim)
    store.write(1, NS, b"k", payload(), cost=1.0)
    assert store.read(1, NS, b"k") == payload() and files(store) == ["0000000000000001.kvb"]
    assert stat.S_ISREG(os.lstat(store.path(1)).st_mode)
    assert (victim.read_bytes() == b"someone's file") if target_exists else not victim.exists()


def test_a_crashs_leftover_temporary_file_is_replaced(tmp_path):
    store = keyed(tmp_path)
    (tmp_path / f".{store.path(1).name}.tmp").write_bytes(b"half a block")
    store.write(1, NS, b"k", payload(), cost=1.0)
    assert store.read(1, NS, b"k") == payload() and files(store) == ["0000000000000001.kvb"]


def test_a_closed_store_does_nothing_more(tmp_path):
    store = keyed(tmp_path)
    store.write(1, NS, b"k", payload(), cost=1.0)
    store.close()
    store.close()                                                       # twice: nothing more
    with pytest.raises(TierReadError):
        store.read(1)
    with pytest.raises(TierWriteError):
        store.write(2, NS, b"k", payload(), cost=1.0)
    assert files(keyed(tmp_path)) == ["0000000000000001.kvb"]
