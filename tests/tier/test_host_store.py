"""HostStore (``tier/host.py``) with real memfd memory: round trips that keep
bytes and identity, one descriptor per block size and none per block,
memory that goes back to the kernel on delete and offsets reused, a failed
write (no memory) that keeps nothing, a read that races a delete getting the
whole block or a clean error, nothing after a restart, the writer thread and
the index driving it as they drive the disk."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from kvelastic.tier.errors import IdentityMismatch, TierMemoryFull, TierReadError, TierWriteError
from kvelastic.tier.host import HostStore
from kvelastic.tier.index import TierIndex
from kvelastic.tier.media import open_store
from kvelastic.tier.restart import rebuild
from kvelastic.tier.writer import TierWriter, WriteJob
from tests.tier.test_writer import results

NS = "llama-3f2a"


def payload(n=4096, seed=1) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def tier_fds() -> int:
    """The process's descriptors of tier memory, as an operator reads them in /proc/PID/fd."""
    return sum("memfd:kvelastic-tier" in os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def test_round_trip_keeps_bytes_and_identity():
    store = open_store("host")
    assert isinstance(store, HostStore) and store.keyed
    store.write(5, NS, b"key-5", payload(), cost=2.5, parent=b"key-4", label=b"event")
    store.write(6, NS, b"key-6", memoryview(payload(100, seed=2)), cost=1.0)
    assert store.read(5, NS, b"key-5") == payload() and store.read(6) == payload(100, seed=2)
    h = store.header(5)
    assert (h.slot, h.namespace, h.key, h.parent, h.nbytes, h.cost, h.label) == \
        (5, NS, b"key-5", b"key-4", 4096, 2.5, b"event")
    assert [e.slot for e in store.scan().entries] == [5, 6] and store.bytes_held == 4196


def test_a_read_of_another_block_or_an_empty_slot_is_refused():
    store = HostStore()
    store.write(1, NS, b"key", payload(), cost=1.0)
    with pytest.raises(IdentityMismatch):
        store.read(1, NS, b"other key")
    with pytest.raises(IdentityMismatch):
        store.read(1, "other-namespace", b"key")
    with pytest.raises(TierReadError):
        store.read(2)
    assert store.read(1, NS, b"key") == payload()       # the refusals changed nothing


def test_one_descriptor_per_block_size_and_memory_back_on_delete():
    store = HostStore()
    before = tier_fds()
    for slot in range(8):
        store.write(slot, NS, b"k%d" % slot, payload(64 << 10, seed=slot), cost=1.0)
    store.write(8, NS, b"small", payload(4096), cost=1.0)
    assert tier_fds() == before + 2                         # two sizes, two arenas; no descriptor per block
    assert store.resident_bytes() >= 8 * (64 << 10) + 4096
    for slot in range(9):
        store.delete(slot)
    assert store.resident_bytes() == 0                      # every hole punched: the memory is the kernel's
    assert store.bytes_held == 0 and not store.scan().entries
    store.delete(3)                                         # absent already: nothing to do
    with pytest.raises(TierReadError):
        store.read(3)
    for slot in range(10, 18):                              # offsets reused: the arena does not grow
        store.write(slot, NS, b"k%d" % slot, payload(64 << 10, seed=slot), cost=1.0)
    assert [store.read(s) for s in range(10, 18)] == [payload(64 << 10, seed=s) for s in range(10, 18)]
    assert store._arenas[64 << 10].end == 8 * (64 << 10)
    store.close()
    assert tier_fds() == before


def test_a_rewrite_of_a_slot_replaces_the_block_and_its_memory():
    store = HostStore()
    store.write(1, NS, b"key", payload(4096), cost=1.0)
    store.write(1, NS, b"key", payload(8192, seed=9), cost=1.0)
    assert store.read(1) == payload(8192, seed=9) and store.bytes_held == 8192
    assert store.resident_bytes() == 8192                   # the first one's memory went


@pytest.mark.parametrize("code, error", [(errno.ENOMEM, TierMemoryFull), (errno.ENOSPC, TierMemoryFull),
                                         (errno.EIO, TierWriteError)])
def test_a_write_without_memory_raises_typed_and_keeps_nothing(monkeypatch, code, error):
    store = HostStore()
    store.write(1, NS, b"kept", payload(), cost=1.0)
    fds, resident = len(os.listdir("/proc/self/fd")), store.resident_bytes()

    def no_room(fd, data, offset):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwrite", no_room)
    with pytest.raises(error) as caught:
        store.write(2, NS, b"new", payload(), cost=1.0)
    monkeypatch.undo()
    assert caught.value.reason == ("memory_full" if error is TierMemoryFull else "io")
    assert len(os.listdir("/proc/self/fd")) == fds and store.resident_bytes() == resident
    assert [e.slot for e in store.scan().entries] == [1] and store.bytes_held == 4096
    assert store.read(1, NS, b"kept") == payload()
    store.write(3, NS, b"again", payload(seed=3), cost=1.0)  # its offset was given back, and is taken again
    assert store._arenas[4096].end == 2 * 4096 and store.read(3) == payload(seed=3)


def test_a_read_racing_a_delete_gets_the_whole_block_or_a_clean_error():
    store = HostStore()
    block = payload(1 << 20)
    outcomes: list[str] = []

    def reader(slot: int) -> None:
        try:
            outcomes.append("whole" if store.read(slot, NS, b"k") == block else "torn")
        except TierReadError:
            outcomes.append("gone")

    for slot in range(50):
        store.write(slot, NS, b"k", block, cost=1.0)
        threads = [threading.Thread(target=reader, args=(slot,)) for _ in range(2)]
        for t in threads:
            t.start()
        store.delete(slot)
        for t in threads:
            t.join(10)
    assert len(outcomes) == 100 and "torn" not in outcomes
    assert store.bytes_held == 0 and not store.scan().entries


def test_a_new_store_holds_nothing_so_a_restart_rebuilds_an_empty_index():
    old = HostStore()
    old.write(1, NS, b"key", payload(), cost=1.0)
    old.close()
    with pytest.raises(TierWriteError):
        old.write(2, NS, b"key", payload(), cost=1.0)
    index = TierIndex(1 << 20, media=("host",))
    found = rebuild(index, HostStore(), now=0.0)
    assert not found.entries and not found.dropped and len(index) == 0


def test_the_writer_and_the_index_drive_it_as_they_drive_the_disk():
    store = HostStore()
    index = TierIndex(3 * 4096, media=("host",))
    writer = TierWriter(store)
    try:
        slots = [index.reserve(NS, b"k%d" % i, 4096, cost=1.0, now=float(i)) for i in range(3)]
        for i, slot in enumerate(slots):
            writer.submit(WriteJob(slot, NS, b"k%d" % i, None, 1.0, payload(4096, seed=i)))
        written, failed = results(writer, 3)
        assert sorted(written) == sorted(slots) and not failed
        for slot in written:
            index.commit(slot)
        # A fourth block evicts the least valuable; its bytes go when the loop deletes the released slot.
        extra = index.reserve(NS, b"k3", 4096, cost=5.0, now=10.0)
        assert extra is not None
        released = index.take_released()
        assert len(released) == 1
        for slot in released:
            writer.delete(slot)
        writer.submit(WriteJob(extra, NS, b"k3", None, 5.0, payload(4096, seed=3)))
        assert results(writer, 1) == ([extra], [])
        held = {e.slot for e in store.scan().entries}
        assert held == (set(slots) - set(released)) | {extra} and store.bytes_held == 3 * 4096
    finally:
        writer.close()
