"""A test double of the tier connector (``tier_run.py --stall``): it pins its
blocks in the tier as the real one does, then never fetches them. The test
marks when it got there (a file at ``KVELASTIC_TEST_STALLED``) and kills the
engine with ``kill -9`` in the middle of the load. A real one cannot be
stopped there on purpose; everything else is the real connector's."""

import os
import threading
from typing import Any

from kvelastic_vllm.tier_connector import KvelasticTierConnector


class StallingTierConnector(KvelasticTierConnector):
    @staticmethod
    def _first_chunks(conn: Any, engine_id: str, lease: int, blocks: int) -> list:
        with open(os.environ["KVELASTIC_TEST_STALLED"], "w") as f:
            f.write(f"{lease} {blocks}")
        threading.Event().wait()         # the lease pinned, its blocks never read: killed here
        return []
