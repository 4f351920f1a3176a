"""TCP ports for the servers the tests and benchmarks start (vLLM's API
server, the daemon's metrics, Prometheus).

A port is picked here and bound later by another process, so something
else may take it in between. Binding port 0 hands out a port from the
kernel's ephemeral range, the very range the kernel then draws from for
every other ``bind(0)`` and outgoing connection on the machine (vLLM's own
ZMQ sockets, the daemon's metrics on port 0, HTTP clients): a parallel test
run took the port of a ``vllm serve`` that way ("Address already in use").
So ports are drawn at random below that range, where only other picks land,
checked free, and never handed out twice by one process."""

from __future__ import annotations

import random
import socket

_LOWEST = 10_000
_handed_out: set[int] = set()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 free now, outside the ephemeral range when there
    is room below it (else one the kernel picks)."""
    high = _ephemeral_low()
    if high - _LOWEST >= 1_000:
        for _ in range(200):
            port = _rng.randrange(_LOWEST, high)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
