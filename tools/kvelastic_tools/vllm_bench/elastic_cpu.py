"""Where the CPU goes in ``kvelastic bench elastic``: the CPU seconds of each
mode's servers, by process (vLLM's API server, ``VLLM::EngineCore``,
``VLLM::Worker``) and, inside them, by the threads kvelastic names
(``kv-engine-io``, ``kv-worker-io``: ``kvelastic/threadname.py``) and ZMQ's,
and of the daemon; read from ``/proc`` before and after each run, so a mode's
cost per request is compared with the others' on the same load. On 2 cores
every thread competes with the model steps: this is the uncontended
scenario's profile, kvelastic's part of it told apart."""

from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK")


def _task_seconds(stat: str) -> tuple[str, float]:
    """(comm, user + system seconds) of one ``/proc/.../stat`` line."""
    head, rest = stat.rsplit(")", 1)
    fields = rest.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / TICK


def _key(process: str, thread: str) -> str:
    """A thread kvelastic or ZMQ named counts apart; the rest go to their process."""
    if thread.startswith("kv-"):
        return f"{process}/{thread}"
    if thread.startswith("ZMQbg"):
        return f"{process}/zmq"
    return process


def _add(out: dict[str, float], key: str, seconds: float) -> None:
    out[key] = out.get(key, 0.0) + seconds


def process_cpu(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/stat") as f:
            process, _ = _task_seconds(f.read())
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                thread, seconds = _task_seconds(f.read())
            _add(out, _key(process, thread), seconds)
    except (OSError, ValueError, IndexError):
        pass                      # the process (or a thread) ended meanwhile
    return out


def group_cpu(pgids: list[int], pids: tuple[int, ...] = ()) -> dict[str, float]:
    """CPU seconds so far of every process in the groups ``pgids`` (each
    server is a process group) and of ``pids`` (the daemon), by key."""
    out: dict[str, float] = {}
    wanted = set(pgids)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) not in wanted:
                continue
        except OSError:
            continue
        for key, seconds in process_cpu(int(entry)).items():
            _add(out, key, seconds)
    for pid in pids:
        for key, seconds in process_cpu(pid).items():
            _add(out, "daemon" + key[len(key.split("/")[0]):], seconds)   # its process, then the thread
    return out


def spent(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """CPU seconds between two readings, by key, largest first; ``total`` and
    ``kvelastic`` (the daemon and the threads kvelastic named) beside them."""
    used = {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
    out = dict(sorted(((k, v) for k, v in used.items() if v > 0), key=lambda kv: -kv[1]))
    out["total"] = round(sum(used.values()), 2)
    out["kvelastic"] = round(sum(v for k, v in used.items() if k.startswith("daemon") or "/kv-" in k), 2)
    return out
