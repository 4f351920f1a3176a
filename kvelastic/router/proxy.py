"""The router's HTTP shell: OpenAI requests in, the chosen engine's reply out.

Per request: the prompt's token ids (given as ids, or from an engine's
``/tokenize``), the indexer's scores, ``Picker.choose``, then the body goes
unchanged to the engine and its reply (streamed or not) comes back with
headers that say what was decided: ``x-kvelastic-engine``,
``x-kvelastic-matched-tokens`` (in the engine's device memory) and
``x-kvelastic-tier-tokens`` (past those, in its node's tier). If the tokenizer or the indexer fails, the
request is still served, routed without scores (counted in
``kvelastic_router_errors``); only a request the router cannot read is refused.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvelastic.errors import IndexerError
from kvelastic.metrics import RouterMetrics
from kvelastic.router.indexer import IndexerClient, Matches
from kvelastic.router.policy import TIER_WEIGHT, Choice, Picker, Policy
from kvelastic.router.tiers import NodeTier, check_tiers, tier_matches

log = logging.getLogger("kvelastic.router")
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_BODY = 64 << 20
ENGINE_TIMEOUT = 600.0


@dataclass(frozen=True)
class Engine:
    id: int
    url: str                    # http://host:port of its vLLM server
    events: str | None = None   # its vLLM KV event endpoints, registered with the indexer at start
    replay: str | None = None


def parse_engine(text: str) -> Engine:
    """``ID=HTTP_URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]``"""
    ident, sep, rest = text.partition("=")
    parts = rest.split(",") if sep else []
    if not ident.isdigit() or int(ident) <= 0 or not parts or len(parts) > 3:
        raise ValueError(f"expected ID=HTTP_URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]] with a positive integer "
                         f"ID, got {text!r}")
    url = urllib.parse.urlsplit(parts[0])
    if url.scheme != "http" or not url.hostname or not url.port:
        raise ValueError(f"engine {ident}: expected an http://HOST:PORT URL, got {parts[0]!r}")
    return Engine(int(ident), parts[0].rstrip("/"), *(p or None for p in parts[1:]))


class RouterState:
    """What the handlers share: the picker, each engine's load, clients, metrics."""

    def __init__(self, engines: list[Engine], indexer: IndexerClient, policy: Policy, model: str,
                 tiers: list[NodeTier] | None = None, tier_weight: float = TIER_WEIGHT) -> None:
        self.engines = {e.id: e for e in engines}
        self.picker = Picker([e.id for e in engines], policy, tier_weight)
        self.tiers = list(tiers or ())
        check_tiers(self.tiers, self.engines)
        self.indexer = indexer
        self.model = model
        self.metrics = RouterMetrics([str(e.id) for e in engines])
        self.lock = threading.Lock()
        self.in_flight = {e.id: 0 for e in engines}
        # Prompt tokens each engine still computes for its requests in flight (the picker's load).
        self.load = {e.id: 0 for e in engines}

    def tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None if they cannot be had."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]           # a batch: routed by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        query: dict[str, Any] = {"model": body.get("model", self.model)}
        if path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
            query["messages"] = body["messages"]
        elif isinstance(prompt, str):
            query["prompt"] = prompt
        else:
            return None
        engine = self.engines[self.picker.engines[0]]
        try:
            reply = _post_json(engine.url + "/tokenize", query, timeout=10.0)
            tokens = reply["tokens"]
            return [int(t) for t in tokens]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.metrics.errors.labels("tokenize").inc()
            log.warning("router: cannot tokenize on engine %d: %s; routing without scores", engine.id, exc)
            return None

    def choose(self, tokens: list[int] | None) -> tuple[Choice, int]:
        """The engine for a request, and the load it adds there (give it back to ``done``)."""
        matches = Matches()
        if tokens and self.picker.policy is Policy.KV:
            try:
                matches = self.indexer.matches(tokens)
            except IndexerError as exc:
                self.metrics.errors.labels("indexer").inc()
                log.warning("router: indexer: %s; routing without scores", exc)
        prompt = len(tokens or ())
        tier = tier_matches(matches.lower, self.tiers)
        with self.lock:
            choice = self.picker.choose(matches.device, self.load, prompt, tier)
            # What the engine computes: the prompt less its hit, a tier load counted at its weight.
            added = max(1, round(self.picker.work(prompt, choice.matched_tokens,
                                                  choice.matched_tokens + choice.tier_tokens)))
            self.in_flight[choice.engine] += 1
            self.load[choice.engine] += added
        engine = str(choice.engine)
        self.metrics.requests.labels(engine).inc()
        self.metrics.prompt_tokens.labels(engine).inc(prompt)
        self.metrics.matched_tokens.labels(engine).inc(choice.matched_tokens)
        return choice, added

    def done(self, engine: int, added: int) -> None:
        with self.lock:
            self.in_flight[engine] -= 1
            self.load[engine] -= added


def _post_json(url: str, body: dict[str, Any], timeout: float) -> Any:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}: {raw[:200]!r}")
        return json.loads(raw)
    finally:
        conn.close()


class RouterHandler(BaseHTTPRequestHandler):
    server: RouterServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # one line per request is the engines' job
        pass

    def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._reply(status, json.dumps({"error": {"message": message, "code": status}}).encode())

    def do_GET(self) -> None:
        state = self.server.state
        if self.path == "/health":
            self._reply(200, json.dumps({"engines": sorted(state.engines), "policy": state.picker.policy.value,
                                         "in_flight": state.in_flight, "load_tokens": state.load,
                                         "tiers": {t.id: list(t.engines) for t in state.tiers},
                                         "tier_weight": state.picker.tier_weight}).encode())
        elif self.path == "/metrics":
            self._reply(200, generate_latest(state.metrics.registry), CONTENT_TYPE_LATEST)
        else:
            self._error(404, f"no such path {self.path!r}")

    def do_POST(self) -> None:
        state = self.server.state
        if self.path not in ROUTED_PATHS:
            self._error(404, f"the router serves {', '.join(ROUTED_PATHS)}, not {self.path!r}")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
            if not 0 < length <= MAX_BODY:
                raise ValueError(f"a body of 1 to {MAX_BODY} bytes is needed")
            raw = self.rfile.read(length)
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            state.metrics.errors.labels("bad_request").inc()
            self._error(400, f"bad request: {exc}")
            return
        choice, added = state.choose(state.tokens(self.path, body))
        finished = False

        def finish() -> None:   # before the reply's last byte: a client's next request sees the load gone
            nonlocal finished
            if not finished:
                finished = True
                state.done(choice.engine, added)

        try:
            self._forward(state.engines[choice.engine], raw, choice, finish)
        finally:
            finish()

    def _forward(self, engine: Engine, raw: bytes, choice: Choice, finish: Callable[[], None]) -> None:
        parts = urllib.parse.urlsplit(engine.url)
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=ENGINE_TIMEOUT)
        try:
            try:
                conn.request("POST", self.path, raw, {"Content-Type": "application/json"})
                resp = conn.getresponse()
            except OSError as exc:
                self.server.state.metrics.errors.labels("engine").inc()
                log.warning("router: engine %d (%s) failed: %s", engine.id, engine.url, exc)
                self._error(502, f"engine {engine.id} failed: {exc}")
                return
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
            self.send_header("x-kvelastic-engine", str(engine.id))
            self.send_header("x-kvelastic-matched-tokens", str(choice.matched_tokens))
            self.send_header("x-kvelastic-tier-tokens", str(choice.tier_tokens))
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            # Relayed as it arrives: a streamed reply's first token reaches the client at once.
            while chunk := resp.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            finish()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            conn.close()


class RouterServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: RouterState) -> None:
        self.state = state
        super().__init__(address, RouterHandler)


def register_engines(engines: list[Engine], indexer: IndexerClient, block_size: int,
                     tiers: list[NodeTier] | None = None) -> int:
    """Register every engine that names its event endpoint, and every node's
    tier stream; returns how many. One the indexer lists already (a router
    before this one registered it: this is a restart, or a second router) is
    registered anew, as ``Registrations`` does: the indexer refuses a second
    registration, and the engine may have restarted since the first."""
    listed = indexer.workers()
    workers = [("engine", e.id, e.events, e.replay) for e in engines if e.events]
    workers += [("tier", t.id, t.events, t.replay) for t in tiers or ()]
    for kind, ident, events, replay in workers:
        if ident in listed:
            indexer.unregister(ident)
        indexer.register(ident, events, replay, block_size)
        log.info("router: %s %d registered with the indexer (%s)", kind, ident, events)
    return len(workers)


class Registrations:
    """Keeps every engine registered with the indexer as engines and the
    indexer come and go. Dynamo's indexer (1.6.1) does not resubscribe to an
    engine that restarted on the same endpoint (it keeps the last life's
    blocks and hears nothing new), nor subscribes to an endpoint nobody has
    bound yet, and an indexer that restarted has no engines. So: an engine
    whose ``/health`` failed twice in a row (it went down: a restart takes
    far longer) and answers again, or one the indexer does not list, is
    registered anew. The new subscription replays the engine's new life from
    its start at the engine's next batch. A node's tier stream has no health
    to ask: it is registered anew when the indexer does not list it. ``run``
    is a thread of its own."""

    def __init__(self, engines: list[Engine], indexer: IndexerClient, block_size: int, metrics: RouterMetrics,
                 interval: float = 1.0, tiers: list[NodeTier] | None = None) -> None:
        self.engines = [e for e in engines if e.events]
        self.tiers = list(tiers or ())
        self.indexer, self.block_size, self.metrics, self.interval = indexer, block_size, metrics, interval
        self.down: set[int] = set()
        self.failures: dict[int, int] = {}     # consecutive failed health checks
        self._stop = threading.Event()

    def check(self) -> None:
        try:
            listed = self.indexer.workers()
        except IndexerError as exc:
            self.metrics.errors.labels("indexer").inc()
            log.warning("router: indexer: %s", exc)
            return
        for engine in self.engines:
            if not _healthy(engine.url):
                self.failures[engine.id] = self.failures.get(engine.id, 0) + 1
                if self.failures[engine.id] == 2:
                    log.warning("router: engine %d (%s) does not answer", engine.id, engine.url)
                    self.down.add(engine.id)
                continue
            self.failures[engine.id] = 0
            if engine.id in self.down or engine.id not in listed:
                try:
                    if engine.id in listed:
                        self.indexer.unregister(engine.id)
                    self.indexer.register(engine.id, engine.events or "", engine.replay, self.block_size)
                except IndexerError as exc:
                    self.metrics.errors.labels("indexer").inc()
                    log.warning("router: cannot register engine %d again: %s", engine.id, exc)
                    continue
                self.down.discard(engine.id)
                self.metrics.registrations.labels(str(engine.id)).inc()
                log.info("router: engine %d registered with the indexer again (%s)", engine.id,
                         "it restarted" if engine.id in listed else "the indexer did not list it")
        for tier in self.tiers:
            if tier.id not in listed:
                try:
                    self.indexer.register(tier.id, tier.events, tier.replay, self.block_size)
                except IndexerError as exc:
                    self.metrics.errors.labels("indexer").inc()
                    log.warning("router: cannot register tier %d again: %s", tier.id, exc)
                    continue
                log.info("router: tier %d registered with the indexer again (the indexer did not list it)",
                         tier.id)

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:   # the watch must outlive any one failure
                log.exception("router: checking the engines' registrations failed")

    def stop(self) -> None:
        self._stop.set()


def _healthy(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def serve(listen: str, engines: list[Engine], indexer_url: str, model: str, block_size: int,
          policy: Policy, tiers: list[NodeTier] | None = None, tier_weight: float = TIER_WEIGHT) -> RouterServer:
    """Register the engines (and the nodes' tier streams), bind, and return the
    server (the caller runs ``serve_forever``)."""
    host, _, port = listen.rpartition(":")
    indexer = IndexerClient(indexer_url, model)
    tiers = list(tiers or ())
    state = RouterState(engines, indexer, policy, model, tiers, tier_weight)    # checks the tiers first
    if policy is Policy.KV:
        register_engines(engines, indexer, block_size, tiers)
    server = RouterServer((host or "127.0.0.1", int(port)), state)
    if policy is Policy.KV:
        watch = Registrations(engines, indexer, block_size, state.metrics, tiers=tiers)
        threading.Thread(target=watch.run, name="kvelastic-router-registrations", daemon=True).start()
    log.info("router: %s policy over %d engine(s) and %d tier(s) on %s:%d", policy.value, len(engines), len(tiers),
             *server.server_address[:2])
    return server
