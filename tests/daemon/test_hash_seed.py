"""Each namespace gets a secret root for its block hashes from the daemon:
the same for every engine of the namespace (their hashes agree, so a cache
can be shared and handed on), different across namespaces and daemons, and
kept across a daemon restart (the key lives beside the socket, mode 0600)."""

import os
import stat

import pytest

from kvelastic import protocol as p
from tests.daemon.hostile import RawEngine, register_message
from tests.daemon_proc import DaemonProcess


def seed_of(daemon: DaemonProcess, engine_id: str, namespace: str) -> str:
    engine = RawEngine(daemon.socket, engine_id)
    try:
        reply = engine.request(register_message(engine_id, namespace=namespace))
        assert isinstance(reply, p.Registered), reply
        engine.request(p.Unregister(engine_id=engine_id))
        return reply.hash_seed
    finally:
        engine.close()


def test_one_seed_per_namespace_kept_across_a_restart(tmp_path):
    (tmp_path / "a").mkdir()
    first = DaemonProcess(tmp_path / "a").start()
    try:
        a1, a2, b = seed_of(first, "e1", "ns-a"), seed_of(first, "e2", "ns-a"), seed_of(first, "e3", "ns-b")
        secret = first.socket + ".hash-secret"
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    finally:
        first.stop()
    assert len(a1) == 64 and a1 == a2 and a1 != b
    again = DaemonProcess(tmp_path / "a").start()          # the same socket folder: the same key
    try:
        assert seed_of(again, "e4", "ns-a") == a1
    finally:
        again.stop()
    (tmp_path / "other").mkdir()
    other = DaemonProcess(tmp_path / "other").start()      # another daemon: nobody can predict a's seeds
    try:
        assert seed_of(other, "e5", "ns-a") != a1
    finally:
        other.stop()


def test_a_readable_key_is_refused_with_its_path(tmp_path):
    daemon = DaemonProcess(tmp_path)
    secret = daemon.socket + ".hash-secret"
    with open(secret, "wb") as f:
        f.write(os.urandom(32))
    os.chmod(secret, 0o644)
    with pytest.raises(RuntimeError, match="hash-secret must belong to this user with mode 0600"):
        daemon.start()
