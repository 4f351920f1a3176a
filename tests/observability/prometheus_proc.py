"""A real Prometheus server in a subprocess, scraping a daemon every second."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

from tests.daemon_proc import free_port


def find(tool: str) -> str | None:
    """``tool`` on PATH, else Debian's location (the ``prometheus`` package)."""
    return shutil.which(tool) or next((p for p in (f"/usr/bin/{tool}",) if os.path.exists(p)), None)


class PrometheusProcess:
    def __init__(self, tmp: pathlib.Path, targets: list[str], binary: str, scrape_interval: str = "1s",
                 rule_files: list[pathlib.Path] | None = None) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = tmp / "prometheus.yml"
        self.data = tmp / "prometheus-data"
        self.log_path = tmp / "prometheus.log"
        config = {
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                       "evaluation_interval": scrape_interval},
            "scrape_configs": [{"job_name": "kvelastic", "static_configs": [{"targets": targets}]}],
        }
        if rule_files:   # alerting and recording rules, evaluated every scrape interval
            config["rule_files"] = [str(pathlib.Path(f).resolve()) for f in rule_files]
        self.config.write_text(json.dumps(config, indent=2))   # JSON is YAML
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self, timeout: float = 20.0) -> PrometheusProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.data}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.started = time.time()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus did not become ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def api(self, path: str, **params) -> dict:
        """GET ``/api/v1/<path>``; returns ``data`` (fails the test on an error status)."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query; the vector's samples as ``{"metric": {...}, "value": float}``."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        assert data["resultType"] == "vector", (expr, data)
        return [{"metric": s["metric"], "value": float(s["value"][1])} for s in data["result"]]

    def value(self, expr: str) -> float | None:
        """The value of a query that yields at most one sample (None when it yields none)."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return result[0]["value"] if result else None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
