"""CURVE for the tier stream's sockets (docs/kv-events.md).

The tier stream carries every tenant's token ids; on TCP nothing says who
connects, so there it needs CURVE: the sockets are CURVE servers with the
operator's certificate, and a ZAP handler (pyzmq's ``ThreadAuthenticator``,
one per ZMQ context) completes a handshake only for the client public keys
the operator allowed. Without a ZAP handler libzmq would take any client
that knows the server's public key, so the handler starts before a socket
binds and stops after they close.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvelastic.errors import ConfigError

log = logging.getLogger("kvelastic.daemon")
ZAP_DOMAIN = "kvelastic-tier"     # only the tier's sockets ask the handler about this domain
LOG_EVERY = 60.0                  # a refused key is logged at most this often


@dataclass(frozen=True)
class CurveServer:
    public_key: bytes             # Z85, as libzmq takes it
    secret_key: bytes
    clients: frozenset[bytes]     # the Z85 public keys allowed to connect


def load_server(cert: str, clients: Sequence[str], setting: str = "KVELASTIC_TIER_EVENTS_CURVE_CERT") -> CurveServer:
    """The server's keys from ``cert`` (ZMQ's certificate format), which only
    the daemon's user may read: a secret key others can read lets them pose
    as the stream to its subscribers, and read what it sends."""
    where = f"{setting}={cert!r}"
    try:
        st = os.stat(cert)
        public, secret = zmq.auth.load_certificate(cert)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot read a CURVE certificate there ({exc})") from None
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(f"{where}: must be owned by the daemon's user (uid {os.geteuid()}) and readable by no "
                          f"one else (it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    if secret is None:
        raise ConfigError(f"{where}: holds no secret-key (the server's certificate is the *.key_secret file)")
    if not clients:
        raise ConfigError(f"{where} needs KVELASTIC_TIER_EVENTS_CURVE_CLIENTS, the subscribers' public keys: "
                          "with none, no one could connect")
    return CurveServer(public, secret, frozenset(k.encode() for k in clients))


class CurveGuard:
    """The ZAP handler of one context, and what makes a socket a CURVE server under it."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], server: CurveServer) -> None:
        self.server = server
        self._warned_at = float("-inf")
        self.refused = 0
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvelastic.daemon.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """The handler's question (on its thread): may client ``key`` connect?"""
        if key in self.server.clients:
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at >= LOG_EVERY:
            self._warned_at = now
            log.warning("tier KV events: CURVE client key %s refused (not in KVELASTIC_TIER_EVENTS_CURVE_CLIENTS; "
                        "%d so far)", key.decode(errors="replace"), self.refused)
        return False

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (not yet bound) a CURVE server whose clients the handler vets."""
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server.secret_key)

    def stop(self) -> None:
        self._auth.stop()
