"""No frame kills the daemon: the undecodable inputs that did (invalid UTF-8
in a string field, deep nesting) and a random-bytes fuzz each get a typed
``malformed`` error, are counted, and leave the daemon serving."""

import random

import msgspec
import zmq

from kvelastic import protocol as p
from tests.daemon.books import rejected


def deep(n: int) -> bytes:
    """``n`` nested one-element arrays around a 0 (msgpack fixarray 0x91)."""
    return b"\x91" * n + b"\x00"


FRAMES = {
    "invalid UTF-8 in a map key": b"\x81\xa4type\xa1\xff",
    "invalid UTF-8 in an engine id": msgspec.msgpack.encode({"type": "Heartbeat", "req_id": 1})[:-1]
    + b"\xa9engine_id\xa2\xff\xfe",
    "1,000 nested arrays in a journal": b"\x84\xa4type\xa7Journal\xa9engine_id\xa1e\xa3ops\x91" + deep(1000)
    + b"\xa9occupancy\x80",
    "1,000 nested arrays in a status": b"\x83\xa4type\xabStatusReply\xa6req_id\x01\xa6status" + deep(1000),
}


def test_undecodable_frames_are_refused_and_the_daemon_lives(daemon):
    before = rejected(daemon).get("malformed", 0)
    for frame in FRAMES.values():
        reply = daemon.send_raw([frame])
        assert isinstance(reply, p.Error) and reply.reason == "malformed", reply
    assert isinstance(daemon.request(p.Status()), p.StatusReply)
    assert rejected(daemon)["malformed"] == before + len(FRAMES)


def test_a_random_bytes_fuzz_never_kills_the_daemon(daemon):
    rng = random.Random(0)
    good = [p.encode(p.Heartbeat(engine_id="x", req_id=1)), p.encode(p.Status(req_id=1))]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{daemon.socket}")
    for _ in range(2000):
        if rng.random() < 0.5:              # mutate a valid frame
            frame = bytearray(rng.choice(good))
            for _ in range(rng.randint(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
            frame = bytes(frame)
        else:                               # or plain noise
            frame = rng.randbytes(rng.randint(1, 64))
        sock.send(frame)
    sock.close(0)
    assert isinstance(daemon.request(p.Status(), timeout=20), p.StatusReply)
    assert daemon.proc.poll() is None
