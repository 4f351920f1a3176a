"""Drive ``peer.py`` engine processes from a test."""

import json
import signal
import subprocess
import sys


def with_engine_token(started: list, engine_id: str, cfg: dict) -> dict:
    """A lone worker process's config gets its engine's secret (the latest
    engine of that id started), as vLLM hands it over with the KV config."""
    if cfg.get("role") == "worker" and "token" not in cfg:
        engine = next(e for e in reversed(started) if e.engine_id == engine_id and e.role == "engine")
        cfg = {**cfg, "token": engine.state()["token"]}
    return cfg


class EngineProcess:
    def __init__(self, socket: str, engine_id: str, *, user: tuple[int, int] | None = None, **cfg) -> None:
        """``user``: (uid, gid) to run as: a tenant other than the daemon's user."""
        self.engine_id = engine_id
        self.role = cfg.get("role", "engine")
        cfg.update(socket=socket, engine_id=engine_id, user=list(user) if user else None)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.daemon.peer", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        assert ready and json.loads(ready)["ready"], f"engine {engine_id} did not start"

    def do(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"engine {self.engine_id} died"
        return json.loads(line)

    def state(self) -> dict:
        return self.do("state")["state"]

    def send(self, msg):
        """A message on this engine's own connection; its reply (None: no answer)."""
        from kvelastic import protocol as p

        reply = self.do("send", msg=p.encode(msg).hex())["reply"]
        return None if reply is None else p.decode(bytes.fromhex(reply))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
