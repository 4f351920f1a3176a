"""What the daemon tests read from a running daemon: held memory, rejection
counters, a settled status, parsed /metrics. Helpers, not tests: test modules
import from here, never from each other."""

import re
import time

MiB = 1 << 20
SLAB = 2 * MiB  # peer.py default: one worker, one 2 MiB page per slab, 4 blocks per slab


def held(daemon, engine_id):
    for e in daemon.status()["engines"]:
        if e["engine_id"] == engine_id:
            return e["held_bytes"]
    return None


def rejected(daemon) -> dict[str, float]:
    out = {}
    for line in daemon.metrics().splitlines():
        if line.startswith("kvelastic_rejected_messages_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def quiet_status(daemon):
    """The status once the engine's journal has settled (two equal reads)."""
    first = daemon.status()
    time.sleep(0.05)
    return first if daemon.status() == first else None


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    samples = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$", line)
        assert m, line
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        samples[(m.group(1), labels)] = float(m.group(4))
    return samples


def value(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]
