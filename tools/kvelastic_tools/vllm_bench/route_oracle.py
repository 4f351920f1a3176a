"""The oracle of ``kvelastic bench route``: an upper bound on any router's prefix hits.

Computed offline from the trace a run recorded, not asked of the engines: one
*unbounded* prefix cache with *perfect placement*, that is every block that
any request of the trace could have put in any engine's cache, asked for each
request's prompt the way vLLM asks its own cache.

- What a request can have put in a cache: its prompt and its reply but the
  reply's last token, in full blocks of ``block`` tokens, each keyed by
  everything before it (vLLM's prefix-cache keys: a block matches only after
  its whole prefix matched). A token's KV is computed when the token is fed
  to the model, and the last token sampled never is: a block that holds it
  is not in any cache unless another request computed it (as its prompt).
  vLLM never caches a partial block.
- Which requests a request can hit: every *other* request sent before its
  first token came back. An engine counts a hit when it schedules the
  request, which comes after the request was sent and before its first token
  is back; a block is in an engine's cache then only if some request
  scheduled earlier (so sent earlier) computed it.
- How vLLM asks: whole blocks from the start, at most ``len(prompt) - 1``
  tokens (the last prompt token is always computed).

So no engine, under any router, gives a request more hit tokens than
``bound`` does: the measured hit tokens over the oracle's is at most 1 per
request, by construction. The bound is a little loose in one place only: two
requests in flight at once that share a prefix nobody computed before are each
credited with the other's (with an "every earlier request" rule, one of them
would be, which vLLM also does when both reach the same engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Seen:
    """One request of a trace, as the client saw it."""
    prompt: Sequence[int]
    reply: Sequence[int]
    sent: float        # when the client sent it (read before sending)
    answered: float    # when its first token came back (read after); if none came, when it ended


def bound(trace: Sequence[Seen], block: int) -> list[int]:
    """Per request of ``trace``, the most prompt tokens any placement of any
    cache could have served it from (a multiple of ``block``)."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    nodes: dict[tuple[int, tuple[int, ...]], int] = {}    # (parent node, block's tokens) -> node
    earliest: list[list[tuple[float, int]]] = []          # per node: the two earliest (sent, request) that had it
    for i, r in enumerate(trace):
        tokens = [*r.prompt, *r.reply[:-1]]
        parent = -1
        for b in range(len(tokens) // block):
            key = (parent, tuple(tokens[b * block:(b + 1) * block]))
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = len(earliest)
                earliest.append([])
            had = earliest[node]
            had.append((r.sent, i))
            had.sort()
            del had[2:]
            parent = node
    out = []
    for i, r in enumerate(trace):
        parent, hit = -1, 0
        for b in range((len(r.prompt) - 1) // block):
            node = nodes.get((parent, tuple(r.prompt[b * block:(b + 1) * block])))
            # Another request that had this block was sent before this one's first token came back.
            # (If the earliest two are this one and a later one, every other is later still.)
            if node is None or not any(j != i and sent < r.answered for sent, j in earliest[node]):
                break
            hit, parent = hit + 1, node
        out.append(hit * block)
    return out
