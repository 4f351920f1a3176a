"""The workload of ``kvelastic bench route``: multi-tenant, multi-turn chats.

Tenants each have a system prompt; users belong to a tenant and hold a
conversation of several turns. Turn k's prompt is the system prompt, then
every earlier user message and the engine's reply to it (the token ids it
generated), then the new message: the longer a conversation, the more of
its prompt one engine already holds, if the turns reach that engine. A fixed
number of users are in flight at once (``concurrency``, slots): each slot
runs its users one after the other, each user waiting for its previous turn
(a closed loop), so new users keep arriving after the start. The first turns
of the first users (every slot starting at once, no engine holding anything)
are the *warm-up*, reported apart. Prompts are token ids (exact lengths, no
tokenizer), sent streaming through the router; the client records when it
sent each request and got its first token, which engine served it, and the
prompt tokens vLLM served from its cache (``usage.prompt_tokens_details``,
engines run with ``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import threading
import time
import urllib.parse
from collections.abc import Callable

VOCAB = (3, 512)          # the tiny model's ordinary token ids (0-2 are <s>, </s>, <pad>)


@dataclasses.dataclass(frozen=True)
class Shape:
    tenants: int
    users: int                # in all, spread over the tenants
    turns: int
    system_len: int           # tokens
    message_len: int          # tokens per user message
    max_tokens: int           # the reply's length
    concurrency: int = 0      # users in flight at once (0: all of them)

    @property
    def slots(self) -> int:
        return self.concurrency or self.users

    @property
    def requests(self) -> int:
        return self.users * self.turns

    @property
    def warmup(self) -> int:
        """The warm-up's requests: the first turn of each slot's first user."""
        return min(self.slots, self.users)


# Per mode and seed: 16 warm-up requests, 404 measured (at least 400, so that a p99 is
# not one request). The longest prompt, 256 + 4 x (48 + 16) + 48 = 560 tokens, fits --max-model-len.
FULL = Shape(tenants=4, users=84, turns=5, system_len=256, message_len=48, max_tokens=16, concurrency=16)
QUICK = Shape(tenants=2, users=8, turns=3, system_len=96, message_len=40, max_tokens=8, concurrency=4)


@dataclasses.dataclass
class Turn:
    user: int
    turn: int
    prompt_tokens: int
    engine: int = 0
    matched: int = 0          # the router's x-kvelastic-matched-tokens
    oracle: int = 0           # the longest prefix any engine really held when it was sent (tokens)
    oracle_best: frozenset[int] = frozenset()   # the engines that held it
    ttft: float | None = None
    error: str = ""
    warmup: bool = False
    prompt: list[int] = dataclasses.field(default_factory=list, repr=False)
    reply: list[int] = dataclasses.field(default_factory=list, repr=False)
    sent: float = 0.0         # time.monotonic() before sending
    answered: float = 0.0     # after its first token came back (or it ended, if none did)
    cached: int | None = None  # prompt tokens vLLM served from its cache (None: not reported)
    bound: int = 0            # route_oracle.bound: the most any cache could have served


@dataclasses.dataclass
class Conversations:
    shape: Shape
    systems: list[list[int]]
    messages: list[list[list[int]]]   # per user, per turn


def make_conversations(shape: Shape, seed: int) -> Conversations:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    systems = [tokens(shape.system_len) for _ in range(shape.tenants)]
    messages = [[tokens(shape.message_len) for _ in range(shape.turns)] for _ in range(shape.users)]
    return Conversations(shape, systems, messages)


@dataclasses.dataclass
class Reply:
    engine: int               # x-kvelastic-engine
    matched: int              # x-kvelastic-matched-tokens
    sent: float               # time.monotonic() just before sending
    first: float | None       # ... just after the first token came back
    ids: list[int]            # the generated token ids
    cached: int | None        # usage.prompt_tokens_details.cached_tokens, if the engine reports it

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


def stream_completion(base: str, prompt: list[int], max_tokens: int, timeout: float = 120.0) -> Reply:
    """One streamed completion through the router (with the usage chunk at the end)."""
    parts = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    out = Reply(0, 0, time.monotonic(), None, [], None)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.engine = int(resp.getheader("x-kvelastic-engine", "0"))
        out.matched = int(resp.getheader("x-kvelastic-matched-tokens", "0"))
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(str(event["error"])[:200])
            for choice in event.get("choices", ()):
                new = choice.get("token_ids") or []
                if new and out.first is None:
                    out.first = time.monotonic()
                out.ids += new
            details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                out.cached = int(details["cached_tokens"])
        resp.read()   # the rest, up to the last chunk: closing earlier resets the router's connection
        return out
    finally:
        conn.close()


def run_conversations(base: str, conv: Conversations,
                      oracle: Callable[[list[int]], tuple[int, frozenset[int]]] | None = None,
                      concurrent: bool = True) -> list[Turn]:
    """Every user's conversation through the router at ``base``; one Turn per
    request. ``oracle(prompt)``, asked just before each request is sent, gives
    the longest prefix any engine really holds and which engines hold it."""
    shape = conv.shape
    out: list[Turn] = []
    lock = threading.Lock()
    histories = [list(conv.systems[u % shape.tenants]) for u in range(shape.users)]

    def step(u: int, k: int) -> None:
        prompt = histories[u] + conv.messages[u][k]
        turn = Turn(u, k, len(prompt), warmup=k == 0 and u < shape.slots, prompt=prompt)
        if oracle is not None:
            turn.oracle, turn.oracle_best = oracle(prompt)
        turn.sent = time.monotonic()
        try:
            got = stream_completion(base, prompt, shape.max_tokens)
            turn.engine, turn.matched, turn.ttft, turn.cached = got.engine, got.matched, got.ttft, got.cached
            turn.sent, turn.answered, reply = got.sent, got.first or time.monotonic(), got.ids
            if len(reply) != shape.max_tokens:
                raise RuntimeError(f"{len(reply)} tokens, expected {shape.max_tokens}")
        except (OSError, RuntimeError, ValueError) as exc:
            turn.error = f"{type(exc).__name__}: {exc}"[:200]
            turn.answered = time.monotonic()
            reply = [VOCAB[0]] * shape.max_tokens
        turn.reply = reply
        with lock:
            out.append(turn)
        histories[u] = prompt + reply

    if concurrent:
        def slot(s: int) -> None:   # its users one after the other, each turn after the one before
            for u in range(s, shape.users, shape.slots):
                for k in range(shape.turns):
                    step(u, k)

        threads = [threading.Thread(target=slot, args=(s,), daemon=True) for s in range(shape.slots)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:   # turn by turn (every user's first turn, then every second ...): each choice can be checked
        for k in range(shape.turns):
            for u in range(shape.users):
                step(u, k)
    return out
