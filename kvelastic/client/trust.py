"""Is the process behind the daemon's socket the daemon? The one rule, for
every client (engines, workers, the operator commands).

A client finds the daemon by a path, and the path may be one anybody could
make first: the per-user default ``/tmp/kvelastic-$UID`` is predictable, and
a folder that is a symbolic link can be re-pointed later. So before a client
says anything (a lifeline's hello names the engine and carries its secret; a
registration follows), it asks the kernel who listens (``SO_PEERCRED`` of the
connected AF_UNIX socket) and goes on only if that is:

- root, or this process's own user (nobody else can run a process as them), or
- the owner of the socket's folder, when nobody else could have made that
  folder where it is: the folder is no symbolic link, no folder above it is
  writable by every user (in a sticky one such as ``/tmp`` the folder's
  entry must be root's or ours), and no link on the way is another user's.
  This is a daemon run as a service user in its own folder, such as
  ``/run/kvelastic`` made by systemd.

Whoever it is, the socket's folder must be a real folder of root, this user
or the daemon's, writable by its owner and group only (what the daemon makes
and insists on itself): nobody else can then put another socket beside the
one that was checked.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

from kvelastic.errors import KvelasticError

_UCRED = struct.Struct("3i")      # pid, uid, gid


class UntrustedDaemon(KvelasticError):
    """The process listening on the daemon's socket is not one this client
    trusts: nothing was sent to it."""

    reason = "untrusted_daemon"

    def __init__(self, message: str, uid: int, expected: tuple[int, ...]) -> None:
        super().__init__(message)
        self.uid = uid                  # the listener's uid, from SO_PEERCRED
        self.expected = expected        # the uids that would have been trusted
        self.message = message


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected AF_UNIX
    socket, as the kernel says (for a client: whoever called ``listen``)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected AF_UNIX socket."""
    return peer_credentials(sock)[1]


def check_daemon(sock: socket.socket, socket_path: str) -> int:
    """Return the uid of the daemon behind ``sock`` (connected to
    ``socket_path`` or to a socket beside it) if this client may talk to it;
    raise ``UntrustedDaemon`` otherwise. ``OSError`` if the folder cannot be
    examined (it went away: try again)."""
    uid = peer_uid(sock)
    me = os.geteuid()
    folder = os.path.dirname(os.path.abspath(socket_path))
    st = os.lstat(folder)
    where = f"the kvelastic socket {socket_path}"
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedDaemon(
            f"{where} is in {folder}, a symbolic link (to {os.readlink(folder)}), which whoever made it can "
            f"re-point at a socket of their own; the process listening there is uid {uid}. Nothing was sent "
            f"to it. Set KVELASTIC_SOCKET to the daemon's real path (in a folder that is no link; "
            f"a daemon refuses to start in a linked one)", uid, (0, me))
    if st.st_uid not in (0, me, uid) or st.st_mode & 0o002:
        whose = (f"belongs to uid {st.st_uid}" if st.st_uid not in (0, me, uid)
                 else f"is writable by every user (mode {st.st_mode & 0o7777:o})")
        raise UntrustedDaemon(
            f"{where} is in {folder}, which {whose}: anybody could have put a socket there; the process "
            f"listening is uid {uid}. Nothing was sent to it. Expected the socket folder of a kvelastic daemon: "
            f"root's, this user's (uid {me}) or the daemon's own, not writable by others; check "
            f"KVELASTIC_SOCKET", uid, (0, me))
    if uid in (0, me):
        return uid
    unsafe = _placed_by_others(folder, me) if uid == st.st_uid else ""
    if uid == st.st_uid and not unsafe:
        return uid
    expected = (0, me)
    owner = (f"; the owner of {folder} (uid {st.st_uid}) would be, but {unsafe}, so anybody could have made "
             f"that folder" if uid == st.st_uid else f" or the owner of {folder} (uid {st.st_uid})")
    raise UntrustedDaemon(
        f"the process listening on {where} runs as uid {uid}; expected root, this user (uid {me}){owner}. "
        f"Nothing was sent to it. Stop that process and start the kvelastic daemon (as root, as this user, or as "
        f"the owner of a socket folder of its own such as /run/kvelastic), or set KVELASTIC_SOCKET to the "
        f"daemon's socket", uid, expected)


def _placed_by_others(folder: str, me: int) -> str:
    """Why someone other than root, ``me`` or the folder's owner could have
    made (or replaced) ``folder`` where it is; ``""`` when nobody could."""
    path = os.path.abspath(folder)
    prefix = "/"
    for name in path.strip("/").split("/"):
        prefix = os.path.join(prefix, name)
        st = os.lstat(prefix)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, me):
            return f"{prefix} is a symbolic link of uid {st.st_uid}"
    child = os.path.realpath(path)
    while child != "/":
        parent = os.path.dirname(child)
        pst = os.stat(parent)
        if pst.st_mode & 0o002:
            sticky = pst.st_mode & stat.S_ISVTX
            if child == os.path.realpath(path) or not sticky or os.lstat(child).st_uid not in (0, me):
                return f"{parent} is writable by every user"
        child = parent
    return ""
