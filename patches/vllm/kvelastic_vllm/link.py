"""An engine's link to the daemon, as the EngineCore side keeps it: the
records ``engine.py`` makes at registration and ``state.py`` holds, below both."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvelastic.client.engine import EngineClient
from kvelastic.core.pool import SlabPool


@dataclasses.dataclass
class Geometry:
    block_stride: int        # bytes of one block in one layer region (or all layers, block-outer)
    regions: int             # pages of a slab in one worker: one per layer (layer-outer) or 1
    blocks_per_slab: int
    block_bytes: int         # one block across every layer and worker
    pages_per_region: int = 1  # consecutive pages of a slab in each region (blocks that no page divides)


@dataclasses.dataclass
class EngineLink:
    pool: SlabPool
    client: EngineClient
    geometry: Geometry
    num_blocks: int
    low_watermark: int       # applied once ElasticBlockPool owns the block records
    block_pool: Any = None   # the ElasticBlockPool serving this engine, once built
