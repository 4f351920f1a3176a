"""The page-descriptor channel: batches, chunking, partial reads, dead peers."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from kvelastic.vmm.errors import FdChannelError, PeerClosed
from kvelastic.vmm.fdchannel import MAX_COMMAND, MAX_FDS, FdChannel, listen


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _memfds(n: int) -> list[int]:
    fds = []
    for i in range(n):
        fd = os.memfd_create(f"t{i}")
        os.ftruncate(fd, 4096 + i)  # size tells them apart on the other side
        fds.append(fd)
    return fds


def _close(fds) -> None:
    for fd in fds:
        os.close(fd)


def test_batch_round_trip() -> None:
    a, b = FdChannel.pair()
    with a, b:
        fds = _memfds(3)
        a.send([(10, fds[0]), (2**64 - 1, fds[1]), (0, fds[2])])
        got = b.recv()
        assert [pid for pid, _ in got] == [10, 2**64 - 1, 0]
        assert [os.fstat(fd).st_size for _, fd in got] == [4096, 4097, 4098]
        assert all(not os.get_inheritable(fd) for _, fd in got)  # close-on-exec
        assert {fd for _, fd in got}.isdisjoint(fds)
        _close(fds)
        _close(fd for _, fd in got)
        a.send([])
        assert b.recv() == []


def test_more_than_scm_max_fd_is_chunked() -> None:
    n = 2 * MAX_FDS + 17
    a, b = FdChannel.pair()
    with a, b:
        fds = _memfds(n)
        sender = threading.Thread(target=a.send, args=([(i, fd) for i, fd in enumerate(fds)],))
        sender.start()
        got = b.recv()
        sender.join()
        assert [pid for pid, _ in got] == list(range(n))
        assert [os.fstat(fd).st_size for _, fd in got] == [4096 + i for i in range(n)]
        _close(fds)
        _close(fd for _, fd in got)


def test_a_command_rides_with_the_last_frame() -> None:
    """The message that names the pages comes in the same read as they do;
    past MAX_FDS it follows the last chunk's descriptors."""
    n = MAX_FDS + 3
    a, b = FdChannel.pair()
    with a, b:
        fds = _memfds(n)
        sender = threading.Thread(target=a.send, args=([(i, fd) for i, fd in enumerate(fds)], b"map them"))
        sender.start()
        got, command = b.recv_batch()
        sender.join()
        assert command == b"map them" and [pid for pid, _ in got] == list(range(n))
        _close(fd for _, fd in got)
        a.send([], b"no pages")
        assert b.recv_batch() == ([], b"no pages")
        # A reader that expects none refuses one, and keeps none of its descriptors.
        before = _open_fds()
        a.send([(7, fds[0])], b"unexpected")
        with pytest.raises(FdChannelError, match="command"):
            b.recv()
        assert _open_fds() == before
        with pytest.raises(FdChannelError, match="command"):
            a.send([], b"x" * (MAX_COMMAND + 1))
        _close(fds)


def test_partial_reads_are_reassembled() -> None:
    a, b = socket.socketpair()
    fds = _memfds(2)
    frame = struct.pack("<HHII", 0x4B56, 2, 0, 0) + struct.pack("<QQ", 5, 6)

    def dribble() -> None:
        socket.send_fds(a, [frame[:1]], fds)  # descriptors ride with the first byte
        for i in range(1, len(frame)):
            time.sleep(0.001)
            a.send(frame[i : i + 1])

    t = threading.Thread(target=dribble)
    t.start()
    got = FdChannel(b).recv()
    t.join()
    assert [pid for pid, _ in got] == [5, 6]
    _close(fds)
    _close(fd for _, fd in got)
    a.close()
    b.close()


def test_peer_closed_before_a_batch() -> None:
    a, b = FdChannel.pair()
    a.close()
    with pytest.raises(PeerClosed) as info:
        b.recv()
    assert info.value.reason == "peer_closed"
    b.close()


def test_peer_closed_mid_frame_leaks_no_descriptor() -> None:
    a, b = socket.socketpair()
    fds = _memfds(3)
    before = _open_fds()
    frame = struct.pack("<HHII", 0x4B56, 3, 0, 0) + struct.pack("<QQQ", 1, 2, 3)
    socket.send_fds(a, [frame[:16]], fds)  # header + part of the ids, then the peer dies
    a.close()
    with pytest.raises(PeerClosed):
        FdChannel(b).recv()
    assert _open_fds() == before - 1  # only the closed socket end is gone: nothing received leaked
    _close(fds)
    b.close()


def test_send_to_a_closed_peer() -> None:
    a, b = FdChannel.pair()
    b.close()
    fds = _memfds(1)
    with pytest.raises(PeerClosed):
        a.send([(1, fds[0])])
    os.fstat(fds[0])  # send never closes the caller's descriptors
    _close(fds)
    a.close()


def test_frame_count_mismatch_is_an_error() -> None:
    a, b = socket.socketpair()
    a.sendall(struct.pack("<HHII", 0x4B56, 1, 0, 0) + struct.pack("<Q", 1))  # announces 1 fd, sends none
    with pytest.raises(FdChannelError, match="announced 1"):
        FdChannel(b).recv()
    a.sendall(b"garbage!" * 2)
    with pytest.raises(FdChannelError, match="magic"):
        FdChannel(b).recv()
    a.close()
    b.close()


def test_bad_pairs_are_refused_before_sending() -> None:
    a, b = FdChannel.pair()
    with a, b:
        with pytest.raises(FdChannelError):
            a.send([(-1, 0)])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp, pytest.raises(FdChannelError):
            FdChannel(tcp)


def test_listen_connect(tmp_path) -> None:
    path = str(tmp_path / "pages.sock")
    listener = listen(path)
    client = FdChannel.connect(path)
    server = FdChannel.accept(listener)
    fds = _memfds(1)
    with client, server:
        server.send([(42, fds[0])])
        ((pid, fd),) = client.recv()
        assert pid == 42 and os.fstat(fd).st_size == 4096
        os.close(fd)
    _close(fds)
    listener.close()
    with pytest.raises(FdChannelError):
        FdChannel.connect(str(tmp_path / "nobody.sock"))
