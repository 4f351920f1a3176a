"""The tier's writer thread (``tier/writer.py``) with a real ``DiskStore``:
a submit never waits for the disk; each write is reported back once, in
order, with its failure's reason; a delete of a slot still queued cancels
its write and leaves no file; close writes what is queued."""

from __future__ import annotations

import os
import select
import threading

from kvelastic.tier.disk import DiskStore
from kvelastic.tier.writer import TierWriter, WriteJob


def job(slot: int, payload: bytes = b"kv" * 100) -> WriteJob:
    return WriteJob(slot, "ns", f"k{slot}".encode(), None, 1.0, payload)


def results(writer: TierWriter, n: int) -> tuple[list[int], list[tuple[int, str]]]:
    """Wait on the wake descriptor (as the loop's poll does) until ``n`` writes are back."""
    written: list[int] = []
    failed: list[tuple[int, str]] = []
    while len(written) + len(failed) < n:
        assert select.select([writer.wake_fd], [], [], 30)[0], "no write came back"
        w, f = writer.finished()
        written += w
        failed += f
    return written, failed


class GatedStore(DiskStore):
    """A disk that writes only once the test opens the gate (a slow disk)."""

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self.gate = threading.Event()

    def write(self, *args, **kwargs) -> None:
        assert self.gate.wait(30)
        super().write(*args, **kwargs)


def test_a_submit_never_waits_for_the_disk_and_every_write_comes_back(tmp_path):
    store = GatedStore(tmp_path)
    writer = TierWriter(store)
    try:
        for slot in range(3):
            writer.submit(job(slot))                    # returns with the disk shut
        assert writer.finished() == ([], []) and writer.queued == {0, 1, 2}
        store.gate.set()
        assert results(writer, 3) == ([0, 1, 2], [])
        assert not writer.queued and writer.queued_bytes == 0
        assert [store.read(s, "ns", f"k{s}".encode()) for s in range(3)] == [b"kv" * 100] * 3
    finally:
        writer.close()


def test_a_delete_while_queued_cancels_the_write_and_leaves_no_file(tmp_path):
    store = GatedStore(tmp_path)
    writer = TierWriter(store)
    try:
        writer.submit(job(0))
        writer.submit(job(1))
        writer.delete(1)                                 # invalidated before its turn
        store.gate.set()
        assert results(writer, 2) == ([0, 1], [])       # 1 comes back too: the index frees it
        assert store.path(0).exists() and not store.path(1).exists()
        assert sorted(os.listdir(tmp_path)) == [store.path(0).name]
    finally:
        writer.close()


def test_a_failed_write_comes_back_with_its_reason_and_leaves_nothing(tmp_path):
    store = DiskStore(tmp_path / "tier")
    writer = TierWriter(store)
    try:
        os.chmod(store.directory, 0o500)                 # the disk refuses writes
        if os.access(store.directory, os.W_OK):          # root ignores the mode: take the directory away
            os.chmod(store.directory, 0o700)
            store.directory.rmdir()                      # (renamed, the store would follow it: it holds the folder)
        writer.submit(job(7))
        assert results(writer, 1) == ([], [(7, "io")])
    finally:
        writer.close()


def test_close_writes_what_is_queued(tmp_path):
    store = DiskStore(tmp_path)
    writer = TierWriter(store)
    for slot in range(5):
        writer.submit(job(slot))
    writer.close()
    assert all(store.path(s).exists() for s in range(5))
