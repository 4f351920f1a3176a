"""The tier's reader threads (``tier/reader.py``): fetches served round-robin
between tenants, then engines, so a tenant with many connections cannot
starve another's single fetch; a block verified whole before a byte of it
goes out, then served by the chunk from the copy held for its engine; the
bytes a tenant holds in the reader capped, a fetch past its share refused
and nothing changed; a deleted slot's fetches answered without reading."""

from __future__ import annotations

import select
import threading

import pytest

from kvelastic.tier.disk import DiskStore
from kvelastic.tier.errors import TierReadError
from kvelastic.tier.reader import ReadDone, ReadJob, TierReader

KiB = 1 << 10
CHUNK = 64 * KiB
ALICE, MALLORY = 6001, 6002


def payload(slot: int, nbytes: int) -> bytes:
    return bytes([slot % 251]) * nbytes


class CountingStore:
    """A store of blocks ``payload(slot, nbytes)`` that records each read (slot,
    tenant's namespace) in order and, when ``gated``, lets each one through
    only when the test releases it (a slow disk, one read at a time)."""

    def __init__(self, nbytes: int, gated: bool = False) -> None:
        self.nbytes = nbytes
        self.gated = gated
        self.reads: list[tuple[int, str]] = []
        self.started = threading.Semaphore(0)      # one per read begun
        self.gate = threading.Semaphore(0)          # one per read let through
        self.lock = threading.Lock()

    def read(self, slot: int, namespace: str | None = None, key: bytes | None = None) -> bytes:
        with self.lock:
            self.reads.append((slot, namespace or ""))
        self.started.release()
        if self.gated:
            assert self.gate.acquire(timeout=30), "the test never let the read through"
        return payload(slot, self.nbytes)


def job(slot: int, tenant: int, engine: str, nbytes: int, offset: int = 0, chunk: int = CHUNK) -> ReadJob[str]:
    return ReadJob(slot, f"ns{tenant}", b"k%d" % slot, nbytes, offset, chunk, tenant, engine,
                   f"{tenant}/{engine}/{slot}@{offset}")


def answers(reader: TierReader[str], n: int) -> list[ReadDone[str]]:
    """Wait on the wake descriptor (as the loop's poll does) until ``n`` answers are back."""
    out: list[ReadDone[str]] = []
    while len(out) < n:
        assert select.select([reader.wake_fd], [], [], 30)[0], f"{n - len(out)} answer(s) never came back"
        out += reader.finished()
    return out


def started(store: CountingStore, n: int = 1) -> None:
    for _ in range(n):
        assert store.started.acquire(timeout=30), "no read began"


def test_one_tenants_many_fetches_never_starve_anothers_single_fetch():
    """One thread, so turns run one after another: Mallory queues 64 fetches
    of 64 blocks over 32 engines; Alice's one fetch, queued while Mallory's
    first read runs, is the very next read, and the rest of Mallory's go on."""
    store = CountingStore(4 * CHUNK, gated=True)
    reader: TierReader[str] = TierReader(store, threads=1, tenant_bytes=1 << 40)
    try:
        for i in range(64):
            assert reader.submit(job(i, MALLORY, f"m{i % 32}", store.nbytes)) == ""
        started(store)                                   # Mallory's first read is running
        assert reader.submit(job(1000, ALICE, "a", store.nbytes)) == ""
        store.gate.release()                             # it ends
        started(store)
        assert store.reads[1] == (1000, f"ns{ALICE}")    # the next read is Alice's
        store.gate.release()
        alice = [d for d in answers(reader, 2) if d.ticket.startswith(f"{ALICE}/")]
        assert [(d.size, d.data, d.error) for d in alice] == [(store.nbytes, payload(1000, CHUNK), "")]
        for _ in range(63):
            store.gate.release()
        assert len(answers(reader, 63)) == 63 and len(store.reads) == 65
        # Mallory's engines took turns too: m0, m1, ... m31, m0, ... (not one engine's queue first).
        assert [slot for slot, ns in store.reads if ns == f"ns{MALLORY}"][:33] == [*range(32), 32]
    finally:
        for _ in range(64):
            store.gate.release()
        reader.close()


def test_a_tenants_slow_read_never_holds_another_tenants_turn():
    """Two threads, one turn per tenant at a time: while Mallory's read hangs
    on the disk, Alice's fetch is read and answered, and Mallory's other
    fetches wait for Mallory's own turn instead of taking the other thread."""
    store = CountingStore(CHUNK, gated=True)
    reader: TierReader[str] = TierReader(store, threads=2, tenant_bytes=1 << 40)
    try:
        for i in range(8):
            reader.submit(job(i, MALLORY, f"m{i}", store.nbytes))
        started(store)
        reader.submit(job(100, ALICE, "a", store.nbytes))
        started(store)
        assert [ns for _, ns in store.reads] == [f"ns{MALLORY}", f"ns{ALICE}"]
        store.gate.release()      # one of the two reads running ends (the semaphore does not say which)
        done = answers(reader, 1)
        assert len(done) == 1 and len(store.reads) <= 3
    finally:
        for _ in range(16):
            store.gate.release()
        reader.close()


def test_a_block_is_verified_whole_then_served_by_the_chunk_from_memory(tmp_path):
    store = DiskStore(tmp_path / "tier")
    block = bytes(range(256)) * (10 * CHUNK // 256 + 3)      # ten chunks and a bit
    store.write(1, "ns", b"k1", block, cost=1.0)
    store.write(2, "ns", b"k2", b"x" * CHUNK, cost=1.0)
    bad = store.path(2)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF                                         # the payload's last byte: it fails its check
    bad.write_bytes(bytes(data))
    reader: TierReader[str] = TierReader(store, tenant_bytes=1 << 40)
    try:
        got = b""
        while True:
            reader.submit(ReadJob(1, "ns", b"k1", len(block), len(got), CHUNK, ALICE, "a", "t"))
            (done,) = answers(reader, 1)
            assert done.size == len(block) and done.error == "" and len(done.data) <= CHUNK
            got += done.data
            if done.finished:
                break
        assert got == block and reader.reads == 1                # read (and checked) once for its 11 chunks
        assert reader.charged(ALICE) == 0                        # its last chunk let the copy go
        reader.submit(ReadJob(2, "ns", b"k2", CHUNK, 0, CHUNK, ALICE, "a", "t"))
        (done,) = answers(reader, 1)
        assert (done.size, done.data, done.finished) == (-1, b"", True) and done.error in ("checksum", "torn")
        reader.submit(ReadJob(1, "other", b"k1", len(block), 0, CHUNK, ALICE, "a", "t"))     # another block's name
        (done,) = answers(reader, 1)
        assert (done.size, done.data, done.error) == (-1, b"", "identity")
        assert reader.charged(ALICE) == 0
    finally:
        reader.close()


def test_each_engine_holds_one_block_which_goes_when_unasked():
    now = [0.0]
    store = CountingStore(4 * CHUNK)
    reader: TierReader[str] = TierReader(store, tenant_bytes=1 << 40, idle=5.0, clock=lambda: now[0])
    try:
        for slot in (1, 2):                                  # each engine: its first chunk of a block
            reader.submit(job(slot, ALICE, f"e{slot}", store.nbytes))
        answers(reader, 2)
        assert reader.charged(ALICE) == 2 * store.nbytes      # each engine's block held for its next chunks
        reader.submit(job(3, ALICE, "e1", store.nbytes))      # e1 asks for another block: it replaces the first
        answers(reader, 1)
        assert reader.charged(ALICE) == 2 * store.nbytes and len(store.reads) == 3
        reader.submit(job(2, ALICE, "e2", store.nbytes, offset=CHUNK))     # served from e2's copy
        answers(reader, 1)
        assert len(store.reads) == 3
        now[0] = 5.5                                          # e1's copy unasked for 5.5 s, e2's for 5.5 s
        reader.submit(job(9, MALLORY, "m", CHUNK))            # any turn lets them go
        answers(reader, 1)
        assert reader.charged(ALICE) == 0
        reader.submit(job(2, ALICE, "e2", store.nbytes, offset=2 * CHUNK))   # read again
        answers(reader, 1)
        assert len(store.reads) == 5
    finally:
        reader.close()


def test_a_fetch_past_the_tenants_share_is_refused_and_changes_nothing():
    store = CountingStore(4 * CHUNK)
    reader: TierReader[str] = TierReader(store, tenant_bytes=2 * store.nbytes + CHUNK)    # two blocks and a chunk
    try:
        for slot in (1, 2):
            assert reader.submit(job(slot, MALLORY, f"m{slot}", store.nbytes)) == ""
            answers(reader, 1)
        held = reader.charged(MALLORY)
        assert held == 2 * store.nbytes                      # each engine's block, held for its next chunks
        assert reader.submit(job(3, MALLORY, "m3", store.nbytes)) == "tenant_bytes"     # a third block
        assert reader.submit(job(3, MALLORY, "m1", store.nbytes)) == "tenant_bytes"     # m1 asking another one
        assert reader.charged(MALLORY) == held and reader.report() == (0, held) and len(store.reads) == 2
        assert reader.submit(job(7, ALICE, "a", store.nbytes)) == ""                     # another tenant's share
        assert answers(reader, 1)[0].size == store.nbytes
        # Its engines may always go on with the blocks they hold (up to CONTINUE_SLACK past the share):
        for offset in (CHUNK, 2 * CHUNK):
            assert reader.submit(job(1, MALLORY, "m1", store.nbytes, offset=offset)) == ""
        assert reader.submit(job(2, MALLORY, "m2", store.nbytes, offset=CHUNK)) == ""
        assert [len(d.data) for d in answers(reader, 3)] == [CHUNK] * 3 and len(store.reads) == 3
        assert reader.submit(job(1, MALLORY, "m1", store.nbytes, offset=3 * CHUNK)) == ""   # m1's last chunk
        assert answers(reader, 1)[0].finished
        assert reader.charged(MALLORY) == store.nbytes       # m1's copy went with it: room for a block again
        assert reader.submit(job(3, MALLORY, "m3", store.nbytes)) == ""
        answers(reader, 1)
    finally:
        reader.close()


def test_chunks_of_a_held_block_pass_the_share_only_by_the_slack():
    from kvelastic.tier.reader import CONTINUE_SLACK

    store = CountingStore(CONTINUE_SLACK + 4 * CHUNK, gated=True)
    reader: TierReader[str] = TierReader(store, threads=1, tenant_bytes=store.nbytes)
    try:
        assert reader.submit(job(1, MALLORY, "m", store.nbytes)) == ""
        started(store)                                       # its read hangs; chunks of it pile up
        admitted = 1
        while reader.submit(job(1, MALLORY, "m", store.nbytes, offset=admitted * CHUNK)) == "":
            admitted += 1
        assert reader.charged(MALLORY) <= store.nbytes + CONTINUE_SLACK + CHUNK
        assert admitted * CHUNK >= CONTINUE_SLACK             # the slack's worth of chunks, no more
    finally:
        store.gate.release()
        reader.close()


def test_a_tenant_with_nothing_in_the_reader_always_has_one_fetch_admitted():
    store = CountingStore(8 * CHUNK)
    reader: TierReader[str] = TierReader(store, tenant_bytes=CHUNK)            # below one block
    try:
        assert reader.submit(job(1, ALICE, "a", store.nbytes, offset=7 * CHUNK)) == ""   # its last chunk
        assert reader.submit(job(2, ALICE, "b", store.nbytes)) == "tenant_bytes"         # while the first is in
        assert answers(reader, 1)[0].finished and reader.charged(ALICE) == 0
        assert reader.submit(job(2, ALICE, "b", store.nbytes)) == ""
        answers(reader, 1)
    finally:
        reader.close()


def test_a_deleted_slots_fetches_are_answered_gone_without_reading():
    store = CountingStore(4 * CHUNK, gated=True)
    reader: TierReader[str] = TierReader(store, threads=1, tenant_bytes=1 << 40)
    try:
        reader.submit(job(1, ALICE, "a", store.nbytes))
        started(store)                                       # slot 1 is being read
        reader.submit(job(2, ALICE, "b", store.nbytes))      # slot 2 waits
        reader.forget([1, 2])                                # both deleted (invalidated)
        store.gate.release()
        done = {d.ticket: d for d in answers(reader, 2)}
        assert done[f"{ALICE}/b/2@0"].error == "gone" and done[f"{ALICE}/b/2@0"].size == -1
        assert [slot for slot, _ in store.reads] == [1]      # slot 2 never read
        assert reader.charged(ALICE) == 0                    # slot 1's copy is not held after its read
    finally:
        store.gate.release()
        reader.close()


def test_many_answers_are_taken_a_pass_at_a_time():
    store = CountingStore(CHUNK)
    reader: TierReader[str] = TierReader(store, tenant_bytes=1 << 40)
    try:
        for slot in range(10):
            reader.submit(job(slot, ALICE, f"e{slot}", store.nbytes))
        got: list[ReadDone[str]] = []
        while len(got) < 10:
            assert select.select([reader.wake_fd], [], [], 30)[0]
            batch = reader.finished(limit=3)
            assert len(batch) <= 3
            got += batch
        assert sorted(d.ticket for d in got) == sorted(f"{ALICE}/e{s}/{s}@0" for s in range(10))
        assert reader.report() == (0, 0)
    finally:
        reader.close()


@pytest.mark.parametrize("error", [TierReadError("bad"), OSError("gone")])
def test_a_failed_read_is_answered_with_its_reason(error):
    class Failing:
        def read(self, slot: int, namespace: str | None = None, key: bytes | None = None) -> bytes:
            raise error

    reader: TierReader[str] = TierReader(Failing())
    try:
        reader.submit(job(1, ALICE, "a", CHUNK))
        (done,) = answers(reader, 1)
        assert (done.size, done.finished, done.error) == (-1, True, "io")
        assert reader.charged(ALICE) == 0
    finally:
        reader.close()
