"""Dynamo's standalone KV indexer (``python -m dynamo.indexer``), as the router asks it.

Its HTTP API (ai-dynamo-runtime 1.6.1): ``/register`` an engine's vLLM event
endpoints as a worker, ``/query`` a model's token ids for matched tokens per
worker (``{"scores": {worker: {dp_rank: tokens}}}``, device memory only, and
``{"instances": {worker: {"gpu", "cpu", "disk", "longest_matched"}}}``, each
medium's tokens: a node's tier publishes ``STORAGE`` blocks, which it files
under ``disk``). The indexer hashes the tokens itself, so the router needs
no hash seed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvelastic.errors import IndexerError


@dataclass(frozen=True)
class Matches:
    """One ``/query``'s answer: matched tokens per worker with a match."""

    device: dict[int, int] = field(default_factory=dict)   # in device memory (``scores``)
    lower: dict[int, int] = field(default_factory=dict)    # in host memory or on disk (a node's tier)


class IndexerClient:
    def __init__(self, base_url: str, model: str, timeout: float = 2.0) -> None:
        self.base = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout

    def _post(self, path: str, body: dict[str, Any] | None, ok: int) -> Any:
        req = urllib.request.Request(self.base + path, None if body is None else json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
                if resp.status != ok:
                    raise IndexerError(f"{path}: HTTP {resp.status}: {raw[:200]!r}")
                return json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            raise IndexerError(f"{path}: HTTP {exc.code}: {exc.read()[:200]!r}") from None
        except (OSError, ValueError) as exc:
            raise IndexerError(f"{path}: {exc}") from None

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str | None, block_size: int) -> None:
        body: dict[str, Any] = {"instance_id": instance_id, "endpoint": endpoint, "model_name": self.model,
                                "block_size": block_size}
        if replay_endpoint:
            body["replay_endpoint"] = replay_endpoint
        self._post("/register", body, 201)

    def unregister(self, instance_id: int) -> None:
        self._post("/unregister", {"instance_id": instance_id, "model_name": self.model}, 200)

    def workers(self) -> set[int]:
        """The engines registered for this model."""
        try:
            with urllib.request.urlopen(self.base + "/workers", timeout=self.timeout) as resp:
                listed = json.loads(resp.read())
            return {int(w["instance_id"]) for w in listed if w.get("model_name") == self.model}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise IndexerError(f"/workers: {exc}") from None

    def scores(self, token_ids: list[int]) -> dict[int, int]:
        """Matched tokens per engine (data-parallel rank 0), engines with a match only."""
        return self.matches(token_ids).device

    def matches(self, token_ids: list[int]) -> Matches:
        """Matched tokens per worker in device memory, and in the lower media
        (the longer of host memory and disk: a tier worker's match)."""
        reply = self._post("/query", {"model_name": self.model, "token_ids": token_ids}, 200)
        try:
            device = {int(worker): int(ranks.get("0", 0)) for worker, ranks in reply["scores"].items()}
            lower = {int(worker): max(int(media.get("cpu", 0)), int(media.get("disk", 0)))
                     for worker, media in (reply.get("instances") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise IndexerError(f"/query: unexpected reply {str(reply)[:200]}") from None
        return Matches(device, {w: n for w, n in lower.items() if n})
