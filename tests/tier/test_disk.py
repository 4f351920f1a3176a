"""DiskStore with real files in tmp_path: round trips, torn and corrupted
files detected by ``read`` and dropped by ``scan``, a full disk that leaves
no file, and the index rebuilt after a restart."""

import errno
import os
import stat

import pytest

from kvelastic.tier.disk import DiskStore
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
    store = DiskStore(tmp_path / "tier")
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


def test_a_label_is_kept_and_a_version_1_file_reads_without_one(tmp_path):
    import struct
    import zlib

    store = DiskStore(tmp_path)
    store.write(3, NS, b"key", payload(), cost=2.0, label=b"the engine's event")
    assert store.header(3).label == b"the engine's event" and store.scan().entries[0].label == b"the engine's event"
    # A file of the first version: pad bytes where the label's length is now.
    head = struct.pack("<4sHHHHH2xQdI", b"KVTB", 1, 0, len(NS), 3, 0, 4096, 2.0, zlib.crc32(payload())) \
        + NS.encode() + b"key"
    store.path(4).write_bytes(head + struct.pack("<I", zlib.crc32(head)) + payload())
    assert store.header(4).label == b"" and store.read(4, NS, b"key") == payload()


def test_short_writes_are_continued(tmp_path, monkeypatch):
    # The kernel may write less than asked: a fake os.write that takes 7 bytes at a time.
    store = DiskStore(tmp_path)
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    store.write(1, NS, b"k", payload(1000), cost=1.0)
    monkeypatch.undo()
    assert store.read(1, NS, b"k") == payload(1000)


def test_a_read_of_another_block_than_asked_is_refused(tmp_path):
    store = DiskStore(tmp_path)
    store.write(1, NS, b"k", payload(), cost=1.0)
    with pytest.raises(IdentityMismatch):
        store.read(1, NS, b"other")
    with pytest.raises(IdentityMismatch):
        store.read(1, "other-ns", b"k")


def test_a_missing_file_is_a_read_error(tmp_path):
    with pytest.raises(TierReadError) as exc:
        DiskStore(tmp_path).read(3)
    assert exc.value.reason == "io"


# ----------------------------------------------------- torn and corrupted
@pytest.mark.parametrize("cut", [0, 10, 60, 4000])
def test_a_truncated_file_is_torn_and_dropped_by_scan(tmp_path, cut):
    store = DiskStore(tmp_path)
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
    store = DiskStore(tmp_path)
    store.write(1, NS, b"k", payload(), cost=1.0)
    flip(store.path(1), os.path.getsize(store.path(1)) - 100)
    with pytest.raises(ChecksumMismatch):
        store.read(1)
    assert [e.slot for e in store.scan().entries] == [1]       # headers only: kept, and read() refuses it
    result = store.scan(verify_payloads=True)
    assert result.entries == [] and result.dropped == {"checksum": 1} and files(store) == []


@pytest.mark.parametrize("offset", [0, 5, 20, 36, 40])   # magic, version, lengths, the namespace, the key
def test_a_flipped_header_byte_is_never_read_as_another_block(tmp_path, offset):
    store = DiskStore(tmp_path)
    store.write(1, NS, b"key", payload(), cost=1.0)
    flip(store.path(1), offset)
    with pytest.raises((ChecksumMismatch, TornBlock)):
        store.read(1)
    result = store.scan()
    assert result.entries == [] and sum(result.dropped.values()) == 1 and files(store) == []


def test_scan_deletes_unfinished_writes_and_leaves_other_files_alone(tmp_path):
    store = DiskStore(tmp_path)
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
    store = DiskStore(tmp_path)
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
    store = DiskStore(tmp_path)
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(TierDiskFull):
        store.write(1, NS, b"k", payload(), cost=1.0)
    assert files(store) == []


# ---------------------------------------------------------------- restart
def test_rebuild_restores_what_checks_and_deletes_the_rest(tmp_path):
    store = DiskStore(tmp_path)
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
    store = DiskStore(tmp_path)
    store.write(0, NS, b"cheap", payload(100), cost=1.0)
    store.write(1, NS, b"dear", payload(100), cost=50.0)
    store.write(2, NS, b"mid", payload(100), cost=5.0)
    index = TierIndex(200)
    rebuild(index, store, now=0.0)
    assert index.stats.evictions["budget"] == 1
    assert files(store) == ["0000000000000001.kvb", "0000000000000002.kvb"]
    index.check()
