"""What the node's tier shares, shared per tenant (uid): audit findings 5, 6
and 7 (docs/tier.md, "Shares").

In process first, on the daemon's own books: a lease keeps slots, never
keys; a tenant's engines together hold at most ``MAX_TENANT_LEASES`` leases
and pin at most their share of the tier (what fits is pinned, then
``busy``, counted); new leases do not keep a block pinned on and on; what
each tenant holds is in ``status``.

Then each attack with a real daemon and processes of other uids (the
tests run as root; ``tests/daemon/test_tenants.py`` has the set-up): reader
engines of one tenant (no slab) opening every lease they may grow the daemon
by a bounded amount (finding 5: 636 MiB for 8 engines); one tenant pinning
all it can leaves room for another tenant's demotions (finding 6: all of the
tier pinned, every other demotion refused); one uid's four engines that
never acknowledge leave staging room for another tenant that does
(finding 7: 0 of its evicted blocks reached the tier).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest

from kvelastic import protocol as p
from kvelastic.daemon import effects as fx
from kvelastic.daemon import report, tiering
from kvelastic.daemon.main import load_hash_secret
from kvelastic.daemon.rejected import Rejected
from kvelastic.daemon.staging import Staging
from kvelastic.daemon.tiering import LEASE_TIMEOUT, Tiering
from kvelastic.tier.disk import DiskStore
from kvelastic.tier.index import TierIndex
from kvelastic.tier.pins import MAX_PIN, MAX_TENANT_PINS
from tests.daemon.hostile import tenant_script
from tests.daemon_proc import DaemonProcess, wait_for
from tests.tier.test_demotion import books_with, demoted, record

GROUP = 4242                       # the socket group every tenant is in (as in test_tenants.py)
ALICE, MALLORY = (6001, GROUP), (6002, GROUP)
ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = 2 * (2 << 20) // 128       # ``demoted``'s blocks: 32 KiB

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run processes as other users")
host_only = pytest.mark.skipif(__import__("tests.backend").backend.TEST_BACKEND != "host",
                               reason="the daemon reads running engines' memfd pages: host backend")


# ------------------------------------------------------------ in process
def leases_rig(n_blocks: int = 8, uids: tuple[int, ...] = (1, 1, 2)):
    """Engines ``a``, ``b``, ... of ``uids`` in namespace ``ns``, on books
    whose tier holds ``n_blocks`` blocks ``k0``... and nothing more."""
    engines = [record(2, 1, 128, engine_id=chr(ord("a") + i)) for i in range(len(uids))]
    for engine, uid in zip(engines, uids):
        engine.uid = uid
    books = books_with(*engines)
    books.tier = TierIndex(n_blocks * BLOCK)
    tiering_ = Tiering(books)
    keys = [f"k{i}".encode() for i in range(n_blocks)]
    demoted(books, tiering_, "ns", keys)
    books.take()
    return books, tiering_, keys


def lookup(tiering_: Tiering, engine: str, keys: list[bytes]) -> p.TierPinned | str:
    """The engine's ``TierLookup``; its reply, or the reason it was refused."""
    try:
        reply = tiering_.on_lookup(engine.encode(), p.TierLookup(engine_id=engine, keys=keys))
    except Rejected as exc:
        return exc.reason.value
    assert isinstance(reply, p.TierPinned)
    return reply


def test_a_lease_keeps_its_slots_not_the_keys_asked_for():
    books, tiering_, keys = leases_rig()
    pinned = lookup(tiering_, "a", keys[:2] + [b"x" * 256] * 100)
    assert isinstance(pinned, p.TierPinned)
    lease = tiering_.leases[pinned.lease]
    assert not hasattr(lease, "keys") and lease.slots == [0, 1]
    tiering_.on_fetch(b"a", p.TierFetch(engine_id="a", lease=pinned.lease, block=1))
    (read,) = [e for e in books.take() if isinstance(e, fx.ReadTierBlock)]
    assert (read.namespace, read.key) == ("ns", keys[1])        # the key a read checks: the index's


def test_one_tenants_engines_hold_at_most_its_leases(monkeypatch):
    monkeypatch.setattr(tiering, "MAX_TENANT_LEASES", 3)
    books, tiering_, keys = leases_rig(n_blocks=16)        # a share of 4 blocks: room for 3 leases of one
    got = [lookup(tiering_, engine, keys[:1]) for engine in "abab"]     # two engines of uid 1
    assert [isinstance(g, p.TierPinned) for g in got] == [True, True, True, False] and got[3] == "busy"
    assert books.tier.stats.refused["leases"] == 1
    assert isinstance(lookup(tiering_, "c", keys[:1]), p.TierPinned)      # uid 2's are its own
    tiering_.on_release(b"a", p.TierRelease(engine_id="a", lease=got[0].lease))
    assert isinstance(lookup(tiering_, "b", keys[:1]), p.TierPinned)      # one ended: room for one
    tiering_.check()
    books.tier.check()


def test_lookups_past_a_tenants_share_pin_what_fits_then_are_refused_busy():
    books, tiering_, keys = leases_rig()                    # 8 blocks; a share is a quarter: 2
    first = lookup(tiering_, "a", keys)
    assert isinstance(first, p.TierPinned) and len(first.nbytes) == 2
    assert lookup(tiering_, "b", keys) == "busy"            # the same tenant's other engine: its share is taken
    other = lookup(tiering_, "c", keys)
    assert isinstance(other, p.TierPinned) and len(other.nbytes) == 2
    tier = books.tier
    assert tier.stats.refused["pin_share"] == 3 and tier.pins.tenants[1].pins == 2
    # A demotion of 4 blocks' worth still finds room: what is not pinned is evicted.
    assert len(demoted(books, tiering_, "other", [f"o{i}".encode() for i in range(4)])) == 4
    assert tier.stats.rejected_full == 0
    tiering_.check()
    tier.check()


def test_new_leases_keep_a_block_pinned_no_longer_than_max_pin_then_it_rests():
    """Finding 6, its second half: a new lookup renewed the pins past the
    lease deadline, so a tenant kept its blocks pinned for ever."""
    books, tiering_, keys = leases_rig(n_blocks=16, uids=(1,))
    tier = books.tier
    got = []
    for t in (0.0, MAX_PIN / 3, 2 * MAX_PIN / 3, MAX_PIN):   # a new lease on the block, each left to expire
        books.now = t
        tiering_.expire()
        got.append(lookup(tiering_, "a", keys[:1]))
    assert [isinstance(g, p.TierPinned) for g in got] == [True, True, True, False] and got[3] == "busy"
    assert tier.stats.refused["pin_held"] == 1
    end = 2 * MAX_PIN / 3 + LEASE_TIMEOUT + 1.0
    books.now = end
    tiering_.expire()                                         # the last lease ended, unloaded
    assert not tiering_.leases and tier.held_bytes == 0       # evictable again, like any block
    books.now = end + end - 1.0                               # it rests as long as it was pinned
    assert lookup(tiering_, "a", keys[:1]) == "busy"
    books.now = end + end
    assert isinstance(lookup(tiering_, "a", keys[:1]), p.TierPinned)
    tiering_.check()
    tier.check()


def test_status_shows_what_each_tenant_holds():
    books, tiering_, keys = leases_rig()
    lookup(tiering_, "a", keys[:2])
    lookup(tiering_, "c", keys[:1])
    shares = report.tier_shares(tiering_, Staging(books, tiering_))
    assert shares is not None and shares.pin_share_bytes == 2 * BLOCK and shares.max_pins == MAX_TENANT_PINS
    assert {uid: (t.pins, t.pinned_bytes, t.leases) for uid, t in shares.tenants.items()} == \
        {"1": (2, 2 * BLOCK, 1), "2": (1, BLOCK, 1)}
    assert report.status(books, shares).tier.shares == shares


# --------------------------------------------------------- real processes
@pytest.fixture
def node():
    """A daemon shared by tenants, with a tier seeded before it starts: its
    folder reachable by all, its sockets the socket group's."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvelastic-shares-"))
    folder.chmod(0o755)
    started: list[DaemonProcess] = []
    procs: list[subprocess.Popen] = []

    def make(seed: dict[str, list[tuple[bytes, int]]] | None = None, **kw) -> DaemonProcess:
        daemon = DaemonProcess(folder, KVELASTIC_SOCKET_GROUP=str(GROUP), KVELASTIC_TIER_DIR=str(folder / "tier"),
                               **kw)
        store = DiskStore(folder / "tier", key=load_hash_secret(daemon.socket))
        slot = 0
        for namespace, blocks in (seed or {}).items():
            for key, nbytes in blocks:
                store.write(slot, namespace, key, bytes(nbytes), cost=1.0)
                slot += 1
        started.append(daemon.start())
        return daemon

    make.procs = procs
    yield make
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for daemon in started:
        daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


def tenant(node, user: tuple[int, int], code: str) -> subprocess.Popen:
    """A process of ``user`` running ``code``; it prints a line when done and
    keeps its connections until its standard input closes."""
    proc = subprocess.Popen(tenant_script(user, code + "\nprint('done', flush=True)\nsys.stdin.readline()\n", ROOT),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    node.procs.append(proc)
    return proc


def lines_until_done(proc: subprocess.Popen) -> list[str]:
    out = []
    while (line := proc.stdout.readline()) and line.strip() != "done":
        out.append(line.strip())
    assert line, proc.stderr.read()
    return out


def rss(daemon: DaemonProcess) -> int:
    """The daemon's resident memory, bytes."""
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def long_key(i: int) -> bytes:
    """A long key (240 bytes: 4,096 of them fill a message); the readers' code makes the same."""
    return (b"%d-" % i).ljust(240, b"k")


READERS = """
import sys
keys = [(b"%d-" % i).ljust(240, b"k") for i in range(4096)]
engines = [RawEngine(SOCKET, f"r{n}") for n in range(8)]
for n, e in enumerate(engines):
    assert type(e.request(register_message(f"r{n}", namespace="reader"))).__name__ == "Registered"
for n, e in enumerate(engines):
    for _ in range(64):
        r = e.request(p.TierLookup(engine_id=f"r{n}", keys=keys), timeout=30)
        print(f"lease {len(r.nbytes)}" if isinstance(r, p.TierPinned) else r.reason, flush=True)
"""


@as_root
def test_reader_engines_of_one_tenant_grow_the_daemon_by_a_bounded_amount(node):
    """Finding 5: eight engines of one uid holding no slab, each opening 64
    leases of 4,096 long keys (240 bytes each), grew the daemon by 636 MiB: a
    lease kept its keys, and nothing bounded a tenant's leases."""
    daemon = node({"reader@uid6001": [(long_key(i), 64) for i in range(4096)]})
    assert daemon.status()["tier"]["blocks"] == 4096
    before = rss(daemon)
    attack = tenant(node, ALICE, READERS.replace("SOCKET", repr(daemon.socket)))
    replies = lines_until_done(attack)
    grown = rss(daemon) - before
    leases = [r for r in replies if r.startswith("lease")]
    # Four leases of 4,096 pins (MAX_TENANT_PINS), every other lookup refused, typed.
    assert leases == ["lease 4096"] * (MAX_TENANT_PINS // 4096)
    assert set(replies) - set(leases) == {"busy"} and len(replies) == 8 * 64
    status = daemon.status()["tier"]
    assert status["shares"]["tenants"]["6001"]["pins"] == MAX_TENANT_PINS
    assert status["counters"]["refused_pin_share"] == 8 * 64 - len(leases)
    print(f"daemon RSS grew {grown / (1 << 20):.1f} MiB")
    assert grown < 48 << 20, f"the daemon grew by {grown >> 20} MiB"


PINNER = """
import sys
keys = [b"m-%d" % i for i in range(128)]
busy = 0
engines = [RawEngine(SOCKET, f"p{n}") for n in range(4)]
for n, e in enumerate(engines):
    assert type(e.request(register_message(f"p{n}", namespace="m"))).__name__ == "Registered"
    for _ in range(64):
        r = e.request(p.TierLookup(engine_id=f"p{n}", keys=keys))
        busy += not isinstance(r, p.TierPinned)
print(busy, flush=True)
"""

# A tenant's running engine (no worker: the daemon holds its pages) that
# caches ``ROUNDS`` prefixes of four 512 KiB blocks in turn on its one slab,
# demotes each, and acknowledges every ticket.
ACKING = """
import sys
e = RawEngine(SOCKET, "alice")
assert type(e.request(register_message("alice", namespace="llama"))).__name__ == "Registered"
assert e.request(p.Grow(engine_id="alice", slabs=1, demand=True)).slabs == [0]
for r in range(ROUNDS):
    ops = [p.StepBegun(r + 1)] + [p.RemoveKey(b"r%d-%d" % (r - 1, b), b) for b in range(4) if r] \\
        + [p.StoreKey(b"r%d-%d" % (r, b), b) for b in range(4)] + [p.StepDone(r + 1)] \\
        + [p.DemoteBlock(b) for b in range(4)]
    e.send(p.Journal(engine_id="alice", ops=ops, occupancy={}))
    while True:
        m = e.recv(3.0)          # within COPY_TIMEOUT of the others' copies, all three rounds
        if m is None or isinstance(m, p.Error):
            print(f"round {r}: no ticket: {m}", flush=True)
            break
        if isinstance(m, p.TierCopied):
            e.send(p.Journal(engine_id="alice", ops=[], occupancy={}, tier_ack=m.ticket))
            break
"""


def alice_blocks(daemon: DaemonProcess) -> int:
    return daemon.status()["tier"]["namespaces"].get("llama@uid6001", 0)


@as_root
@host_only
def test_one_tenant_pinning_all_it_can_leaves_room_for_another_tenants_demotions(node):
    """Finding 6: pins were bounded per engine only, so one tenant's engines
    pinned the whole tier, and every demotion of another tenant was refused
    (``rejected_full``)."""
    block = 64 << 10
    daemon = node({"m@uid6002": [(b"m-%d" % i, block) for i in range(128)]}, KVELASTIC_TIER_SIZE=str(128 * block),
                  memory="16MiB")
    assert daemon.status()["tier"]["bytes"] == 128 * block                    # the tier full of mallory's
    pinner = tenant(node, MALLORY, PINNER.replace("SOCKET", repr(daemon.socket)))
    busy = int(lines_until_done(pinner)[-1])
    shares = daemon.status()["tier"]["shares"]
    assert shares["tenants"]["6002"]["pinned_bytes"] <= shares["pin_share_bytes"] == 32 * block
    assert busy == 4 * 64 - 1                          # one lease of its share, every other lookup refused
    alice = tenant(node, ALICE, ACKING.replace("SOCKET", repr(daemon.socket)).replace("ROUNDS", "3"))
    assert lines_until_done(alice) == []
    wait_for(lambda: alice_blocks(daemon) == 12, what="alice's demoted blocks in the tier")
    counters = daemon.status()["tier"]["counters"]
    assert counters["rejected_full"] == 0 and counters["evictions_value"] >= 12 * 8
    assert daemon.status()["tier"]["shares"]["tenants"]["6002"]["pins"] == 32      # still pinned meanwhile


HOLDERS = """
import sys
engines = [RawEngine(SOCKET, f"h{n}") for n in range(4)]
tickets = 0
for n, e in enumerate(engines):
    assert type(e.request(register_message(f"h{n}", namespace="m"))).__name__ == "Registered"
    slabs = []
    while len(slabs) < 8:
        slabs += e.request(p.Grow(engine_id=f"h{n}", slabs=8 - len(slabs), demand=True), timeout=15).slabs
    blocks = [4 * s + k for s in slabs for k in range(4)]
    ops = [p.StepBegun(1)] + [p.StoreKey(b"h%d-%d" % (n, b), b) for b in blocks] + [p.StepDone(1)] \\
        + [p.DemoteBlock(b) for b in blocks]
    assert type(e.request(p.Journal(engine_id=f"h{n}", ops=ops, occupancy={}, sync=True))).__name__ == "Ok"
"""


@as_root
@host_only
def test_one_uids_engines_that_never_acknowledge_leave_staging_to_another_tenant(node):
    """Finding 7: staging's bounds were global and per engine, so four
    engines of one uid that never acknowledge held all of it, and another
    tenant that acknowledges every ticket got none of its evicted blocks
    into the tier."""
    daemon = node(KVELASTIC_TIER_SIZE="256MiB", memory="80MiB")
    holders = tenant(node, MALLORY, HOLDERS.replace("SOCKET", repr(daemon.socket)))
    lines_until_done(holders)
    shares = daemon.status()["tier"]["shares"]
    assert shares["tenants"]["6002"]["staged_bytes"] == shares["staging_share_bytes"] == 32 << 20
    alice = tenant(node, ALICE, ACKING.replace("SOCKET", repr(daemon.socket)).replace("ROUNDS", "3"))
    assert lines_until_done(alice) == []
    wait_for(lambda: alice_blocks(daemon) == 12, what="alice's demoted blocks in the tier")
    assert daemon.status()["tier"]["counters"]["refused_staging"] == 64      # the two engines past its share
