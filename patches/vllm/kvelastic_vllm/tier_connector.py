"""``KvelasticTierConnector``: vLLM loads KV blocks back from the node's tier
(docs/tier.md) through its KV connector API. Off unless configured::

    --kv-transfer-config '{"kv_connector":"KvelasticTierConnector",
      "kv_connector_module_path":"kvelastic_vllm.tier_connector",
      "kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

and inert without ``KVELASTIC_ENABLE=1`` (no daemon to ask). This slice
loads only; the daemon demotes (kept cache of departed engines).

Scheduler side (the EngineCore): on a device miss, ``get_num_new_matched_tokens``
asks the daemon for the longest run of the request's next keys the tier
holds for this engine's namespace (``TierLookup``: the keys the pool
journals, vLLM's block hash and the group's suffix, so they are the kept
cache's), fetches their bytes at once (``TierFetch``, in chunks under the
message bound; the daemon checks each block and drops one that fails,
so only blocks that read well are counted) and answers with a *sync* load
of them: vLLM allocates the blocks and runs the request in the same step.
The bytes ride to the workers in the step's connector metadata, and each
worker copies them into the blocks before the forward pass (after vLLM
zeroed new blocks). At least one prompt token is always left to compute.

Worker side: ``register_kv_caches`` only records the views (the arena has
no page mapped yet: touching a byte would kill the worker); a block's
payload is each worker's part, rank after rank, and a worker's part its
bytes layer after layer in address order, which is the daemon's region
order (``kvelastic/daemon/tiering.py``). Every worker gets the whole payload
in the step's metadata and copies its own part: with tensor parallelism its
heads of every layer, with pipeline stages its layers (the daemon gives every
worker the same pages per slab, so the parts are equal).

One KV cache group and one data-parallel rank in this version; otherwise
the connector finds nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvelastic import protocol as p

log = logging.getLogger("kvelastic.vllm")

# Bytes of fetched blocks kept for requests not admitted yet (looked up again otherwise),
# and requests whose answer is kept (a miss too: a request that waits is not asked about again).
MAX_HELD_BYTES = 256 << 20
MAX_HELD_REQUESTS = 4096
CALL_TIMEOUT = 5.0

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _DISK: Any = CacheHitSource.DISK
except ImportError:   # an older vLLM: its default source
    _DISK = None


@dataclasses.dataclass
class TierLoadMeta(KVConnectorMetadata):
    loads: list[tuple[list[int], list[bytes]]] = dataclasses.field(default_factory=list)  # (block ids, payloads)


@dataclasses.dataclass
class _Fetched:
    first: int                 # the request's first block the payloads are for
    payloads: list[bytes]


class KvelasticTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if _DISK is not None:
            self._cache_hit_source = _DISK
        self.block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None])
        self.workers = max(1, int(parallel.world_size))          # tensor x pipeline ranks, each a worker
        self.enabled = groups == 1 and int(getattr(parallel, "data_parallel_size", 1)) == 1
        if not self.enabled:
            log.warning("kvelastic: the tier connector loads nothing here (%d KV cache groups, %d data-parallel "
                        "ranks: one of each in this version)", groups, parallel.data_parallel_size)
        self._held: OrderedDict[str, _Fetched] = OrderedDict()   # by request id, oldest first
        self._held_bytes = 0
        self._pending: list[tuple[list[int], list[bytes]]] = []
        self._suffix = b""
        self._kv: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._rank: int | None = None          # this worker's rank (worker side, once known)

    # ------------------------------------------------------- scheduler side
    def _link(self) -> Any:
        from kvelastic_vllm.state import state

        return state().link

    def _key_suffix(self) -> bytes:
        if not self._suffix:
            from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

            self._suffix = make_block_hash_with_group_id(BlockHash(b""), 0)
        return self._suffix

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        first = num_computed_tokens // self.block_size
        held = self._held.get(request.request_id)
        if held is not None and held.first == first:
            return len(held.payloads) * self.block_size, False
        self._drop(request.request_id)
        link = self._link()
        # Full blocks beyond the local hit, leaving at least one prompt token to compute.
        last = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        if not self.enabled or link is None or last <= first:
            return 0, False
        suffix = self._key_suffix()
        keys = [bytes(h) + suffix for h in request.block_hashes[first:last][:p.MAX_TIER_KEYS]]
        payloads = self._fetch(link.client, keys, link.geometry.block_bytes)
        self._held[request.request_id] = _Fetched(first, payloads)
        self._held_bytes += sum(len(b) for b in payloads)
        while len(self._held) > 1 and (len(self._held) > MAX_HELD_REQUESTS or self._held_bytes > MAX_HELD_BYTES):
            self._drop(next(iter(self._held)))
        return len(payloads) * self.block_size, False

    def _fetch(self, client: Any, keys: list[bytes], block_bytes: int) -> list[bytes]:
        """The bytes of the longest run of ``keys`` the tier holds and reads well.

        Every block's first chunk is asked for at once (``call_async``), not
        one round trip after another: a round trip costs the same for a 32 KiB
        block as for a 1 MiB one, and was what a load cost (``bench tier``).
        A block larger than a chunk has its other chunks fetched after."""
        from kvelastic.client.connection import DaemonError, DaemonUnavailable

        engine_id = client.engine_id
        lease = 0           # pinned and not ended yet: released on every way out
        try:
            pinned = client.conn.call(p.TierLookup(engine_id=engine_id, keys=keys), CALL_TIMEOUT)
            if not isinstance(pinned, p.TierPinned) or not pinned.lease:
                return []
            lease = pinned.lease
            wanted = 0
            while wanted < len(pinned.nbytes) and pinned.nbytes[wanted] == block_bytes:
                wanted += 1
            firsts = self._first_chunks(client.conn, engine_id, pinned.lease, wanted)
            payloads: list[bytes] = []
            for block, reply in enumerate(firsts):
                if not isinstance(reply, p.TierData) or reply.size != block_bytes or reply.offset != 0 \
                        or not reply.data:
                    break
                data = bytearray(reply.data)
                try:
                    while len(data) < block_bytes:
                        more = client.conn.call(p.TierFetch(engine_id=engine_id, lease=pinned.lease, block=block,
                                                            offset=len(data)), CALL_TIMEOUT)
                        if not isinstance(more, p.TierData) or more.size != block_bytes \
                                or more.offset != len(data) or not more.data:
                            break
                        data += more.data
                except DaemonError as exc:     # refused (the tenant's share of the reads is full): what is whole stays
                    log.info("kvelastic: tier block %d of lease %d not loaded: %s", block, pinned.lease, exc)
                if len(data) != block_bytes:
                    break
                payloads.append(bytes(data))
            if len(payloads) == len(pinned.nbytes):
                lease = 0       # each block's last chunk unpinned it: the lease is over
            return payloads
        except (DaemonError, DaemonUnavailable) as exc:
            log.warning("kvelastic: tier lookup failed, computing instead: %s", exc)
            return []
        finally:
            if lease:           # the rest of its pins go now, not at its deadline
                try:
                    client.conn.call(p.TierRelease(engine_id=engine_id, lease=lease), CALL_TIMEOUT)
                except (DaemonError, DaemonUnavailable) as exc:
                    log.warning("kvelastic: tier lease %d not released (its deadline ends it): %s", lease, exc)

    @staticmethod
    def _first_chunks(conn: Any, engine_id: str, lease: int, blocks: int) -> list[p.Msg | None]:
        """The first chunk of blocks ``0 .. blocks - 1`` of ``lease``, asked
        for together; None for one not answered within ``CALL_TIMEOUT``."""
        from kvelastic.client.connection import DaemonUnavailable

        replies: list[p.Msg | None] = [None] * blocks
        left = [blocks]
        done = threading.Event()
        lock = threading.Lock()

        def answered(block: int) -> Callable[[p.Msg], None]:
            def on_reply(reply: p.Msg) -> None:      # the I/O thread
                with lock:
                    replies[block] = reply
                    left[0] -= 1
                    if not left[0]:
                        done.set()
            return on_reply

        if not blocks:
            return []
        for block in range(blocks):
            conn.call_async(p.TierFetch(engine_id=engine_id, lease=lease, block=block, offset=0), answered(block))
        if not done.wait(CALL_TIMEOUT):
            raise DaemonUnavailable(f"{left[0]} of {blocks} tier blocks not answered within {CALL_TIMEOUT:g} s")
        return replies

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        held = self._drop(request.request_id)
        n = num_external_tokens // self.block_size
        if held is None or n <= 0:
            return
        ids = blocks.get_block_ids()[0]
        self._pending.append((list(ids[held.first:held.first + n]), held.payloads[:n]))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = TierLoadMeta(loads=self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._drop(request.request_id)
        return False, None

    def _drop(self, request_id: str) -> _Fetched | None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self._held_bytes -= sum(len(b) for b in held.payloads)
        return held

    # ---------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = dict(kv_caches)      # views only: no page is mapped yet

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TierLoadMeta):
            return
        for ids, payloads in meta.loads:
            for block_id, payload in zip(ids, payloads):
                if not self._scatter(block_id, payload):
                    self._load_errors.add(block_id)

    def _worker_rank(self) -> int:
        """This worker's rank among the engine's, as the daemon numbers them (its registration's)."""
        if self._rank is None:
            from kvelastic_vllm.state import state
            from kvelastic_vllm.worker import _rank

            worker = state().worker
            self._rank = worker.rank if worker is not None else _rank()
        return self._rank

    def _scatter(self, block_id: int, payload: bytes) -> bool:
        """Copy this worker's part of a block's payload into its views, piece
        by piece in address order."""
        part, rest = divmod(len(payload), self.workers)
        rank = self._worker_rank()
        if rest or not 0 <= rank < self.workers:
            log.error("kvelastic: a tier block of %d bytes does not split between %d workers (this one rank %d)",
                      len(payload), self.workers, rank)
            return False
        payload = payload[rank * part:(rank + 1) * part]
        pieces: dict[int, torch.Tensor] = {}
        for view in self._kv.values():
            piece = view[block_id]
            pieces.setdefault(piece.data_ptr(), piece)
        ordered = [pieces[ptr] for ptr in sorted(pieces)]
        sizes = [t.numel() * t.element_size() for t in ordered]
        if sum(sizes) != len(payload) or not all(t.is_contiguous() for t in ordered):
            log.error("kvelastic: a tier block of %d bytes does not fit block %d (%d bytes)", len(payload),
                      block_id, sum(sizes))
            return False
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        at = 0
        for t, n in zip(ordered, sizes):
            t.view(-1).view(torch.uint8).copy_(src[at:at + n])
            at += n
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
