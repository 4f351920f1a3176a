"""Tenants that cannot touch each other, and a loop nothing can stall.

Each test is a finding of the review of bf4a9e5, reproduced the way a hostile
tenant makes it: a process of another uid in the socket group (the README's
multi-tenant set-up: ``KVELASTIC_SOCKET_GROUP``), with the project's own
clients or raw frames, against a real daemon on host pages. Alice and
Mallory are two tenants (uids 6001 and 6002); the tests run as root, which
is what lets them start processes as other users.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from kvelastic import protocol as p
from tests.daemon.books import rejected
from tests.daemon.hostile import RawEngine, StatusProbe, register_message, tenant_script
from tests.daemon_proc import DaemonProcess, wait_for

GROUP = 4242                       # the socket group every tenant is in
ALICE, MALLORY = (6001, GROUP), (6002, GROUP)
ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run processes as other users")


@pytest.fixture
def shared():
    """A daemon shared by tenants: its folder reachable by all, its sockets
    the socket group's."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvelastic-tenants-"))
    folder.chmod(0o755)
    started: list[DaemonProcess] = []

    def make(**kw) -> DaemonProcess:
        kw.setdefault("metrics", True)
        daemon = DaemonProcess(folder, KVELASTIC_SOCKET_GROUP=str(GROUP), **kw).start()
        started.append(daemon)
        return daemon

    yield make
    for daemon in started:
        daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


def as_tenant(user: tuple[int, int], code: str, timeout: float = 60.0) -> str:
    """Run ``code`` in a process of ``user``; its standard output."""
    out = subprocess.run(tenant_script(user, code, ROOT), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def engine_entry(daemon, engine_id: str) -> dict | None:
    return next((e for e in daemon.status()["engines"] if e["engine_id"] == engine_id), None)


def tenant_engine(daemon, engine_id: str) -> dict | None:
    """The entry of a tenant's engine, whatever the daemon calls it (``id@uidN``)."""
    return next((e for e in daemon.status()["engines"] if e["engine_id"].split("@uid")[0] == engine_id), None)


def holds_for(seconds: float, condition) -> bool:
    """``condition`` stays true for ``seconds`` (what must NOT happen, watched
    over a window: a slow machine only makes the check weaker, never flaky)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not condition():
            return False
        time.sleep(0.05)
    return True


def pages(daemon) -> dict:
    return daemon.status()["pages"]


# ------------------------------------------------------------- finding 1
def test_a_hello_naming_another_engine_never_kills_it(shared, engines):
    """Finding 1: a page-channel hello naming a victim engine with rank -2 (or
    -1 without its secret), then closed, dropped the engine and unmapped its
    live blocks under it. Now such a hello is refused or speaks for nobody."""
    daemon = shared()
    victim = engines(daemon, "victim", user=ALICE)
    assert victim.do("ensure", n=4)["ok"] and victim.do("alloc", n=4)["ok"]
    written = victim.do("write", value=5)["values"]
    name = "victim@uid6001"
    wait_for(lambda: tenant_engine(daemon, "victim")["live_blocks"] == 4, what="the victim's journal")

    attack = f"""
import socket
from kvelastic import protocol as p
for engine_id in ("victim", {name!r}):
    for rank in (-2, -1, 0):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(p.fd_socket_path({daemon.socket!r}))
        hello = p.Hello(p.PROTOCOL_VERSION, engine_id, rank, b"")   # any rank, no secret
        data = __import__("msgspec").msgpack.encode(hello)
        s.sendall(len(data).to_bytes(4, "little") + data)
        s.close()
print("done")
"""
    bad_before = rejected(daemon).get("bad_hello", 0)
    assert as_tenant(MALLORY, attack).strip() == "done"
    as_root = attack.replace('for engine_id in ("victim", ', 'for engine_id in (')   # even from an operator's process
    assert as_tenant((0, 0), as_root).strip() == "done"
    assert holds_for(2.0, lambda: (e := tenant_engine(daemon, "victim")) is not None and e["slabs"] == 1)
    wait_for(lambda: rejected(daemon).get("bad_hello", 0) >= bad_before + 3, what="rank -2 hellos refused")
    assert tenant_engine(daemon, "victim")["engine_id"] == name
    assert victim.do("read")["values"] == written            # its pages are still mapped, its KV intact
    assert victim.do("ensure", n=8)["ok"]                    # and it still grows


def test_acks_on_a_page_channel_speak_only_for_the_channels_own_worker(shared, engines):
    """Protocol 2: workers acknowledge on their page channel. Another tenant
    (and an operator's process without the secret) opens channels naming a
    victim's worker, with valid hellos, and sends valid-looking acks for the
    slab it holds: each is refused as ``not_owner``, and the victim keeps its
    slab, its KV and its growth."""
    daemon = shared()
    victim = engines(daemon, "victim", user=ALICE)
    assert victim.do("ensure", n=4)["ok"] and victim.do("alloc", n=4)["ok"]
    written = victim.do("write", value=7)["values"]
    name = "victim@uid6001"
    wait_for(lambda: tenant_engine(daemon, "victim")["live_blocks"] == 4, what="the victim's journal")
    attack = f"""
import socket, msgspec
from kvelastic import protocol as p
def frame(m):
    data = msgspec.msgpack.encode(m) if isinstance(m, p.Hello) else p.encode(m)
    return len(data).to_bytes(4, "little") + data
for engine_id in ("victim", {name!r}):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(p.fd_socket_path({daemon.socket!r}))
    s.sendall(frame(p.Hello(p.PROTOCOL_VERSION, engine_id, 0, b""))
              + frame(p.Unmapped(req_id=1 << 32, engine_id=engine_id, rank=0, slab=0))
              + frame(p.Mapped(req_id=(1 << 32) + 1, engine_id=engine_id, rank=0, slab=0)))
    s.close()
print("done")
"""
    before = rejected(daemon).get("not_owner", 0)
    assert as_tenant(MALLORY, attack).strip() == "done"
    as_root = attack.replace('for engine_id in ("victim", ', 'for engine_id in (')
    assert as_tenant((0, 0), as_root).strip() == "done"
    wait_for(lambda: rejected(daemon).get("not_owner", 0) >= before + 6, what="every forged ack refused")
    assert tenant_engine(daemon, "victim")["slabs"] == 1
    assert victim.do("read")["values"] == written            # its pages are still mapped, its KV intact
    assert victim.do("ensure", n=8)["ok"]                    # and its own worker still acknowledges


def test_a_journal_on_a_lifeline_speaks_only_for_the_lifelines_own_engine(shared, engines):
    """Protocol 3: an engine writes its journal on its lifeline. Another
    tenant (and an operator's process without the secret) opens lifelines
    naming a victim engine and writes journals that would drop the victim's
    cached keys, store keys of its own in the victim's blocks and mark a step
    done: each frame is refused as ``not_owner``, the victim's books do not
    change, and its own journal still counts."""
    daemon = shared()
    victim = engines(daemon, "victim", user=ALICE)
    assert victim.do("ensure", n=4)["ok"] and victim.do("alloc", n=4)["ok"]
    victim.do("cache", prefix="v")
    victim.do("free")
    victim.do("flush")
    name = "victim@uid6001"
    wait_for(lambda: tenant_engine(daemon, "victim")["cached_blocks"] == 4, what="the victim's journal")
    attack = f"""
import socket, msgspec
from kvelastic import protocol as p
def frame(data):
    return len(data).to_bytes(4, "little") + data
poison = [("clear",), ("step", 1)] + [("store", b"poison-%d" % i, i) for i in range(4)] + [("done", 1)]
for engine_id in NAMES:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(p.fd_socket_path({daemon.socket!r}))
    s.sendall(frame(msgspec.msgpack.encode(p.Hello(p.PROTOCOL_VERSION, engine_id, -1, b"")))
              + frame(p.encode(p.JournalFrame(engine_id=engine_id, ops=poison, occupancy={{}}))))
    s.close()
print("done")
"""
    before = rejected(daemon).get("not_owner", 0)
    assert as_tenant(MALLORY, f"NAMES = ('victim', {name!r})\n" + attack).strip() == "done"
    assert as_tenant((0, 0), f"NAMES = ({name!r},)\n" + attack).strip() == "done"
    # Mallory's names are hers (victim@uid6002, ...: no such engine); the operator's is Alice's engine.
    wait_for(lambda: rejected(daemon).get("not_owner", 0) >= before + 3, what="the forged journals refused")
    assert holds_for(1.0, lambda: tenant_engine(daemon, "victim")["cached_blocks"] == 4)
    assert tenant_engine(daemon, "victim")["engine_id"] == name
    assert victim.do("alloc", n=2)["ok"]                       # its own journal: two blocks live
    victim.do("flush")
    wait_for(lambda: tenant_engine(daemon, "victim")["live_blocks"] == 2, what="the victim's own journal")


# ------------------------------------------------------------- finding 2
def test_a_registration_cannot_freeze_the_loop(shared):
    """Finding 2: blocks_per_slab = 2**40 was accepted and the loop walked
    every block id on unregister. Geometry is now bounded by what the engine
    could hold, and departure costs what it held."""
    daemon = shared()
    e = RawEngine(daemon.socket, "huge")
    try:
        reply = e.request(register_message("huge", blocks_per_slab=2 ** 40, block_bytes=1))
        assert isinstance(reply, p.Error) and reply.reason == "geometry", reply
        for bad in (dict(num_workers=10 ** 6), dict(pages_per_worker=10 ** 9), dict(block_tokens=10 ** 9)):
            reply = e.request(register_message("huge", **bad))
            assert isinstance(reply, p.Error) and reply.reason == "geometry", (bad, reply)
        # The largest geometry a slab allows: a block of one byte, 2 Mi blocks per slab.
        assert isinstance(e.request(register_message("huge", blocks_per_slab=p.MAX_MESSAGE_BYTES * 2,
                                                     block_bytes=1)), p.Registered)
        assert e.request(p.Grow(engine_id="huge", slabs=1, demand=True)).slabs == [0]
        probe = StatusProbe(daemon.socket, timeout=2.0)
        e.send(p.Journal(engine_id="huge", ops=[p.StepBegun(step=1)] + [
            p.StoreKey(key=b"k%d" % i, block=i * 997) for i in range(2000)] + [p.StepDone(step=1)], occupancy={}))
        assert isinstance(e.request(p.Unregister(engine_id="huge")), p.Ok)
        wait_for(lambda: daemon.status()["memory"]["held"] == 0, what="its slab back")
        latencies = probe.stop()
        assert max(latencies) < 1.0, f"Status took up to {max(latencies):.2f} s"
    finally:
        e.close()


# ------------------------------------------------------------- finding 3
def cache_and_leave(engine, prefix: str, value: int) -> None:
    """Cache 4 blocks in a finished step, journal acknowledged, then SIGKILL."""
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


def test_a_namespace_belongs_to_its_tenant(shared, engines):
    """Finding 3: a tenant of another uid registered with tenant A's
    namespace, mapped A's kept cache, read its KV, got its hash seed, and
    left its own bytes under A's keys. Now namespaces are the tenant's own."""
    daemon = shared(memory="8MiB")
    keep = {"grace": 60, "journal_interval": 3600}
    alice = engines(daemon, "a", user=ALICE, namespace="llama", **keep)
    seed = alice.state()["hash_seed"]
    cache_and_leave(alice, "sys", value=7)
    wait_for(lambda: any(o["namespace"].startswith("llama") and o["blocks"] == 4 for o in daemon.status()["orphans"]),
             what="alice's cache kept")
    kept_for = [o["namespace"] for o in daemon.status()["orphans"]]

    for namespace in ("llama", "llama@uid6001"):       # the name, and the name as the daemon shows it
        mallory = engines(daemon, f"m-{len(namespace)}", user=MALLORY, namespace=namespace, **keep)
        assert mallory.state()["hash_seed"] != seed
        assert mallory.do("ensure", n=4)["ok"]
        assert mallory.do("lookup", prefix="sys", n=4)["hits"] == 0          # nothing of alice's adopted
        assert set(mallory.do("read")["values"]) == {0}                      # fresh pages, not hers
        assert engine_entry(daemon, f"m-{len(namespace)}@uid6002")["namespace"] == f"{namespace}@uid6002"
        cache_and_leave(mallory, "sys", value=66)                            # her bytes under the same keys

    alice2 = engines(daemon, "a", user=ALICE, namespace="llama", **keep)
    assert alice2.state()["hash_seed"] == seed
    assert alice2.do("ensure", n=4)["ok"]
    assert alice2.do("lookup", prefix="sys", n=4)["hits"] == 4               # her own cache, warm
    values = set(alice2.do("read")["values"])
    assert 7 in values and 66 not in values                                   # her bytes, never mallory's
    assert kept_for == ["llama@uid6001"]                                      # kept for her namespace only


# ------------------------------------------------------------- finding 4
def test_an_id_registered_again_while_departing_loses_no_page(shared, engines):
    """Finding 4: the second departing record of a reused engine id
    overwrote the first while it was still unmapping: its pages left the
    books for good. Now departing records are kept per registration."""
    daemon = shared(memory="16MiB", KVELASTIC_ACK_TIMEOUT="60s", KVELASTIC_ORPHAN_CACHE_TTL="0")
    first = engines(daemon, "e", workers=1, ranks=[])
    w1 = engines(daemon, "e", role="worker", rank=0)
    assert first.do("ensure", n=8)["ok"]                          # 2 slabs, mapped by w1
    w1.proc.send_signal(signal.SIGSTOP)                           # its unmaps will not be acknowledged
    try:
        first.close()                                             # unregisters: departing, unmapping
        wait_for(lambda: engine_entry(daemon, "e") is None, what="the first e departing")
        second = engines(daemon, "e", workers=1, ranks=[])        # the same id, registered again
        w2 = engines(daemon, "e", role="worker", rank=0)
        assert second.do("ensure", n=8)["ok"]
        second.close()
        w2.close()
        wait_for(lambda: engine_entry(daemon, "e") is None, what="the second e gone")
    finally:
        w1.proc.send_signal(signal.SIGCONT)
    w1.kill()
    wait_for(lambda: daemon.status()["memory"]["held"] == 0, what="every slab back")
    status = daemon.status()
    counts, memory = status["pages"], status["memory"]
    assert counts["created"] == counts["free"] and counts["quarantined"] == 0, counts   # none lost
    assert memory["free"] + memory["unallocated"] == 16 << 20, memory


# ------------------------------------------------------------- finding 5
def test_a_journal_names_only_slabs_the_engine_holds(shared):
    """Finding 5: a journal could add any slab id and key its blocks, and the
    daemon kept them all. Now only granted slabs may be named."""
    daemon = shared()
    e = RawEngine(daemon.socket, "j")
    try:
        assert isinstance(e.request(register_message("j")), p.Registered)
        assert e.request(p.Grow(engine_id="j", slabs=1, demand=True)).slabs == [0]
        for ops in ([p.AddSlab(slab=7)], [p.StoreKey(key=b"x", block=4 * 7)], [p.RemoveSlab(slab=9)],
                    [p.AddSlab(slab=1 << 40), p.StoreKey(key=b"y", block=4 << 40)]):
            reply = e.request(p.Journal(engine_id="j", ops=ops, occupancy={}, sync=True))
            assert isinstance(reply, p.Error) and reply.reason == "bad_journal", (ops, reply)
        ok = e.request(p.Journal(engine_id="j", ops=[p.StoreKey(key=b"z", block=3)], occupancy={0: (0, 1, 3)},
                                 sync=True))
        assert isinstance(ok, p.Ok)
        assert engine_entry(daemon, "j")["cached_blocks"] == 1
    finally:
        e.close()


# ------------------------------------------------------------- finding 7
def test_a_tenant_cannot_run_the_daemon_out_of_descriptors(shared, engines):
    """Finding 7: lifelines naming a registered engine were never closed and
    needed no secret; a tenant holding enough of them made a page export
    fail, the map command go out without its descriptors and a healthy
    engine fail. Now a tenant's channels are capped (a share of the
    descriptor limit), wrong-secret ones are closed, and an export failure
    fails a slab, never the engine."""
    daemon = shared(nofile=1024)                # 32 pages of budget: a tenant may hold (1024-32-256)//4 = 184
    legit = engines(daemon, "legit", workers=1)
    assert legit.do("ensure", n=4)["ok"]
    hog = f"""
import resource, socket, time
from kvelastic import protocol as p
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
held = []
for i in range(1100):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(p.fd_socket_path({daemon.socket!r}))
        p.write_hello(s, "legit", -1)
    except OSError:
        s.close()
        continue
    held.append(s)
def still_open():
    n = 0
    for s in held:
        s.setblocking(False)
        try:
            n += s.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            n += 1
        except OSError:
            pass
    return n
deadline = time.monotonic() + 30       # connections still in the backlog are refused once accepted
while (n := still_open()) > 184 and time.monotonic() < deadline:
    time.sleep(0.05)
print(n)
"""
    still_open = int(as_tenant(MALLORY, hog))
    assert still_open <= 184, still_open
    assert rejected(daemon).get("channel_limit", 0) >= 1100 - 184 - 256    # at most a backlog's worth waited
    assert legit.do("ensure", n=12)["ok"]                                  # grows, its pages exported and sent
    assert legit.state()["failed"] == ""
    assert engine_entry(daemon, "legit")["slabs"] >= 3


def test_an_export_failure_fails_the_slab_not_the_engine(shared, engines):
    """The operator's own processes are not capped: when they run the daemon
    out of descriptors a page export fails; nothing is sent to the worker,
    the grow gets fewer slabs and the engine carries on."""
    daemon = shared(nofile=256)
    legit = engines(daemon, "legit", workers=1, grace=0.2)
    assert legit.do("ensure", n=40)["ok"]                       # 10 pages made for it...
    wait_for(lambda: engine_entry(daemon, "legit")["slabs"] == 0, timeout=20, what="its reserve back")
    held = []                                                   # ...free under its name: reused without creating
    fds = pathlib.Path(f"/proc/{daemon.proc.pid}/fd")
    deadline = time.monotonic() + 30
    try:
        while len(list(fds.iterdir())) < 256 and time.monotonic() < deadline:   # root: all the daemon has
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(1.0)
            try:
                s.connect(p.fd_socket_path(daemon.socket))
                p.write_hello(s, f"hog-{len(held)}", -1)        # a lifeline: kept for the register timeout
            except OSError:                                     # the backlog is full: the daemon catches up
                s.close()
                time.sleep(0.01)
                continue
            held.append(s)
        assert len(list(fds.iterdir())) == 256, "the daemon kept descriptors to spare"
        legit.do("ensure", n=40, timeout=2.0)
        wait_for(lambda: "not sent to worker" in daemon.log(), what="an export that failed\n" + daemon.log())
        assert legit.state()["failed"] == ""
    finally:
        for s in held:
            s.close()
    # No new control connection until the daemon has closed its ends: libzmq
    # aborts on a connection it cannot accept (see docs/architecture.md, Not yet).
    wait_for(lambda: len(list(fds.iterdir())) < 200, timeout=30, what="the daemon's descriptors back")
    # Its ZMQ listener then drains what waited in its backlog: each question is asked until answered.
    def answered(question):
        def ask():
            try:
                return question()
            except TimeoutError:
                return None
        return wait_for(lambda: (daemon.proc.poll() is None or pytest.fail(daemon.log())) and ask(), timeout=30,
                        what="the daemon answering again")

    assert answered(lambda: engine_entry(daemon, "legit")) is not None
    assert answered(lambda: legit.do("ensure", n=40, timeout=2.0)["ok"])    # it grows
    assert legit.state()["failed"] == "" and answered(lambda: pages(daemon))["quarantined"] == 0


# ------------------------------------------------------------- finding 8
def test_a_long_step_is_not_a_hung_worker(shared, engines):
    """Finding 8: a model step longer than the ack timeout that overlapped a
    reclaim failed its engine and quarantined the budget. The worker now
    says it is busy while its step holds the unmap."""
    daemon = shared(memory="8MiB", KVELASTIC_ACK_TIMEOUT="2s", KVELASTIC_GROW_TIMEOUT="15s")
    long = engines(daemon, "long", workers=1, grace=60)
    assert long.do("ensure", n=16)["ok"]                           # the whole budget (4 slabs)
    assert long.do("alloc", n=16)["ok"]
    long.do("cache", prefix="c")
    long.do("free")                                                # all cached: reclaimable
    long.do("flush")
    long.do("worker_step")                                         # a model step begins, and lasts
    other = engines(daemon, "other", workers=1)
    other.proc.stdin.write('{"op": "ensure", "n": 8, "timeout": 15}\n')   # a demand: reclaims from long
    other.proc.stdin.flush()
    wait_for(lambda: "asked to give up" in daemon.log(), timeout=10, what="the reclaim begun")
    assert holds_for(5.0, lambda: engine_entry(daemon, "long") is not None and pages(daemon)["quarantined"] == 0)
    long.do("worker_step_end")                                     # the step ends: the unmaps go through
    import json
    answer = json.loads(other.proc.stdout.readline())
    assert answer["ok"], answer
    assert long.state()["failed"] == "" and pages(daemon)["quarantined"] == 0


def test_a_failed_engine_is_told_and_a_late_ack_frees_its_pages(shared, engines):
    """A worker that really hangs still fails its engine; the engine is told,
    and when the worker wakes and acknowledges the unmap it was asked for,
    the quarantined pages come back without waiting for its process to exit."""
    # 3 s: a map on a loaded machine must not miss it (that would fail the
    # engine before the test freezes its worker); the unmaps below must.
    daemon = shared(memory="8MiB", KVELASTIC_ACK_TIMEOUT="3s")
    frozen = engines(daemon, "frozen", workers=1, ranks=[], grace=60)
    worker = engines(daemon, "frozen", role="worker", rank=0)
    assert frozen.do("ensure", n=8)["ok"]                          # 2 slabs
    assert not frozen.state()["failed"] and pages(daemon)["quarantined"] == 0
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        frozen.close()                                             # unregisters: its unmaps go unacknowledged
        wait_for(lambda: pages(daemon)["quarantined"] == 2, timeout=10, what="its pages quarantined")
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: pages(daemon)["quarantined"] == 0, timeout=10, what="the late acks free them")
    assert worker.proc.poll() is None                              # while its process still lives
    counts = pages(daemon)
    assert counts["created"] == counts["free"], counts


def test_a_failed_engine_hears_it(shared, engines):
    daemon = shared(memory="8MiB", KVELASTIC_ACK_TIMEOUT="1s")
    engine = engines(daemon, "told", workers=1, ranks=[], grace=60)
    worker = engines(daemon, "told", role="worker", rank=0)
    worker.proc.send_signal(signal.SIGSTOP)                        # cannot map: the grow's map ack is missed
    try:
        engine.proc.stdin.write('{"op": "ensure", "n": 4, "timeout": 3}\n')
        engine.proc.stdin.flush()
        engine.proc.stdout.readline()
        wait_for(lambda: engine.state()["failed"], timeout=10, what="the engine told it failed")
        assert "no map/unmap acknowledgement" in engine.state()["failed"]
    finally:
        worker.proc.send_signal(signal.SIGCONT)


# ------------------------------------------------------------- finding 9
def test_a_large_grow_does_not_hold_the_loop(shared):
    """Finding 9: pages were created one at a time in one dispatch and a free
    slab id cost a scan of every slab held: a 16,384-page grow blocked
    Status for 5 to 10 s. Now creation is batched between passes."""
    daemon = shared(memory="32GiB", metrics=False)     # 16,384 pages (memfds never touched cost no RAM)
    e = RawEngine(daemon.socket, "big")
    try:
        assert isinstance(e.request(register_message("big")), p.Registered)
        probe = StatusProbe(daemon.socket, timeout=5.0, interval=0.02)
        granted = 0
        for _ in range(4):
            reply = e.request(p.Grow(engine_id="big", slabs=4096, demand=True), timeout=60)
            granted += len(reply.slabs)
        latencies = sorted(probe.stop())
        assert granted == 16384
        # p90 and the worst, not p99: one sample in a hundred can lose a loaded machine's CPU for 0.5 s,
        # while the bug held every Status for seconds.
        p90, worst = latencies[int(len(latencies) * 0.9)], latencies[-1]
        assert p90 < 0.5 and worst < 2.5, f"Status p90 {p90:.2f} s, max {worst:.2f} s while 16,384 pages were created"
    finally:
        e.close()


# ------------------------------------------------------------ finding 11
def test_operator_requests_need_the_operators_credential(shared, engines):
    """Finding 11: any tenant could set another's limits, invalidate its
    cache, declare a guaranteed minimum, or register its engine id first."""
    daemon = shared()
    squat = f"""
from tests.daemon.hostile import RawEngine, register_message
from kvelastic import protocol as p
e = RawEngine({daemon.socket!r}, "alice-engine")
print(type(e.request(register_message("alice-engine"))).__name__, flush=True)   # first, with alice's id
sys.stdin.readline()
for msg in (p.SetLimit(engine_id="alice-engine@uid6001", min_bytes=0, max_bytes=2 << 20),
            p.Invalidate(target="alice-engine@uid6001"), p.Invalidate(target="hostile@uid6001"),
            register_message("other", min_bytes=4 << 20)):
    print(getattr(e.request(msg), "reason", "accepted"), flush=True)
e.close()
"""
    mallory = subprocess.Popen(tenant_script(MALLORY, squat, ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=ROOT)
    try:
        assert mallory.stdout.readline().strip() == "Registered"
        alice = engines(daemon, "alice-engine", user=ALICE, namespace="hostile")   # starts all the same
        assert alice.do("ensure", n=4)["ok"]
        mallory.stdin.write("go\n")
        mallory.stdin.flush()
        out = [mallory.stdout.readline().strip() for _ in range(4)]
        assert out == ["not_operator"] * 4, out
    finally:
        mallory.stdin.close()
        mallory.wait(10)
    ids = {e["engine_id"] for e in daemon.status()["engines"]}
    assert "alice-engine@uid6001" in ids and "alice-engine" not in ids
    # The operator (root here) may.
    assert isinstance(daemon.request(p.SetLimit(engine_id="alice-engine@uid6001", min_bytes=0,
                                                max_bytes=8 << 20)), p.Ok)
    assert rejected(daemon).get("not_operator") == 4


def test_only_the_operator_or_the_namespaces_owner_may_invalidate_its_kept_cache(shared, engines):
    """``invalidate`` reaches kept cache with no engine running; a
    tenant may drop its own, never another's."""
    from tests.daemon.test_orphan_cache import KEEP, cache_in_a_step, kept_blocks

    daemon = shared(memory="4MiB")
    a = engines(daemon, "a", user=ALICE, namespace="llama", **KEEP)
    assert a.do("ensure", n=4)["ok"]
    cache_in_a_step(a, "sys", 4, value=7)
    a.do("flush")
    a.kill()
    wait_for(lambda: kept_blocks(daemon, "llama@uid6001") == 4, timeout=30, what="alice's cache kept")

    def invalidate_as(user, target: str) -> str:
        return as_tenant(user, f"e = RawEngine({daemon.socket!r}, 'probe')\n"
                               f"r = e.request(p.Invalidate(target={target!r}))\n"
                               "print(getattr(r, 'reason', None) or f'kept {r.kept_blocks}', flush=True)\n").strip()

    assert invalidate_as(MALLORY, "llama@uid6001") == "not_operator"     # another tenant's, by its full name
    assert invalidate_as(MALLORY, "a@uid6001") == "not_operator"         # or by the engine that left it
    assert invalidate_as(MALLORY, "llama") == "unknown_target"           # its own "llama": it has none
    assert kept_blocks(daemon, "llama@uid6001") == 4
    assert invalidate_as(ALICE, "llama") == "kept 4"                     # the owner, by its own name
    assert daemon.status()["orphans"] == []
    assert rejected(daemon).get("not_operator") == 2


def test_only_the_operator_or_the_namespaces_owner_may_invalidate_its_tier_blocks(shared):
    """``invalidate`` reaches the node's tier; a tenant of another
    uid can drop neither another tenant's blocks nor the operator's."""
    from kvelastic.daemon.main import load_hash_secret
    from kvelastic.tier.disk import DiskStore

    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvelastic-tier-"))
    daemon = shared(KVELASTIC_TIER_DIR=str(folder))
    daemon.stop()                                                           # its key made: blocks a former one left
    store = DiskStore(folder, key=load_hash_secret(daemon.socket))
    store.write(0, "llama@uid6001", b"alice's", b"a" * 4096, cost=1.0)     # alice's namespace
    store.write(1, "model", b"operator's", b"o" * 4096, cost=1.0)           # the operator's engines'
    daemon.start()

    def invalidate_as(user, target: str) -> str:
        return as_tenant(user, f"e = RawEngine({daemon.socket!r}, 'probe')\n"
                               f"r = e.request(p.Invalidate(target={target!r}))\n"
                               "print(getattr(r, 'reason', None) or f'tier {r.tier_blocks}', flush=True)\n").strip()

    try:
        assert invalidate_as(MALLORY, "llama@uid6001") == "not_operator"
        assert invalidate_as(MALLORY, "model") == "not_operator"
        assert invalidate_as(MALLORY, "llama") == "unknown_target"      # its own "llama": it has none
        assert daemon.status()["tier"]["namespaces"] == {"llama@uid6001": 1, "model": 1}
        assert sorted(os.listdir(folder)) == [store.path(0).name, store.path(1).name]
        assert invalidate_as(ALICE, "llama") == "tier 1"                 # the owner, by its own name
        assert daemon.status()["tier"]["namespaces"] == {"model": 1}
        assert os.listdir(folder) == [store.path(1).name]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
