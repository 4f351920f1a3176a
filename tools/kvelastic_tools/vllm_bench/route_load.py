"""The workload of ``kvelastic bench route``: multi-tenant, multi-turn chats.

Tenants each have a system prompt; users belong to a tenant and hold a
conversation of several turns. Turn k's prompt is the system prompt, then
every earlier user message and the engine's reply to it (the token ids it
generated), then the new message: the longer a conversation, the more of
its prompt one engine already holds, if the turns reach that engine. Users
run concurrently, each waiting for its previous turn (a closed loop). Prompts
are token ids (exact lengths, no tokenizer), sent streaming through the
router; the client records time to first token and which engine served it.
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
    users: int                # spread over the tenants
    turns: int
    system_len: int           # tokens
    message_len: int          # tokens per user message
    max_tokens: int           # the reply's length


FULL = Shape(tenants=4, users=16, turns=5, system_len=256, message_len=48, max_tokens=16)
QUICK = Shape(tenants=3, users=6, turns=3, system_len=192, message_len=40, max_tokens=8)


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


def stream_completion(base: str, prompt: list[int], max_tokens: int,
                      timeout: float = 120.0) -> tuple[int, int, float | None, list[int]]:
    """One streamed completion: (engine, matched tokens, TTFT, generated ids)."""
    parts = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    sent = time.monotonic()
    ttft: float | None = None
    ids: list[int] = []
    try:
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        engine = int(resp.getheader("x-kvelastic-engine", "0"))
        matched = int(resp.getheader("x-kvelastic-matched-tokens", "0"))
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
                if new and ttft is None:
                    ttft = time.monotonic() - sent
                ids += new
        return engine, matched, ttft, ids
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
        turn = Turn(u, k, len(prompt))
        if oracle is not None:
            turn.oracle, turn.oracle_best = oracle(prompt)
        try:
            turn.engine, turn.matched, turn.ttft, reply = stream_completion(base, prompt, shape.max_tokens)
            if len(reply) != shape.max_tokens:
                raise RuntimeError(f"{len(reply)} tokens, expected {shape.max_tokens}")
        except (OSError, RuntimeError, ValueError) as exc:
            turn.error = f"{type(exc).__name__}: {exc}"[:200]
            reply = [VOCAB[0]] * shape.max_tokens
        with lock:
            out.append(turn)
        histories[u] = prompt + reply

    if concurrent:
        def user(u: int) -> None:
            for k in range(shape.turns):
                step(u, k)

        threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(shape.users)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:   # turn by turn (every user's first turn, then every second ...): each choice can be checked
        for k in range(shape.turns):
            for u in range(shape.users):
                step(u, k)
    return out
