"""A request resumed after an async KV load (a connector's) skips the lookup
that puts the pool's demand hooks on; the plugin's wrap of
``Scheduler._update_waiting_for_remote_kv`` puts them on there, so the
allocation for the rest of its prompt can still grow the pool, under the
same conditions as the lookup's wrap, and keeps the original's face."""

import inspect
import types

import pytest

pytest.importorskip("vllm")

import kvelastic_vllm
from kvelastic_vllm import demand


class Elastic:
    """Stands for ElasticBlockPool: a demand record and whether it may grow."""

    def __init__(self, may_grow: bool = True, hearing: object = None) -> None:
        self.may_grow = may_grow
        self.demand = types.SimpleNamespace(manager=hearing)


def original(self, request, *args):
    """vLLM's: promotes a loaded request."""
    return ("promoted", request)


@pytest.mark.parametrize("pool,heard", [
    (Elastic(), True),
    (Elastic(may_grow=False), False),            # at its cap, or just refused: no demand
    (Elastic(hearing=object()), False),          # hooks on already this step
    (object(), False),                           # vLLM's own block pool
])
def test_a_request_resumed_after_its_load_grows_the_pool(monkeypatch, pool, heard):
    calls = []
    monkeypatch.setattr(demand, "hear", lambda manager, p: calls.append((manager, p)))
    wrapped = kvelastic_vllm.wrap_resumed_after_load(original, Elastic)
    manager = types.SimpleNamespace(block_pool=pool)
    scheduler = types.SimpleNamespace(kv_cache_manager=manager)
    assert wrapped(scheduler, "req") == ("promoted", "req")
    assert calls == ([(manager, pool)] if heard else [])
    assert inspect.signature(wrapped) == inspect.signature(original) and wrapped.__name__ == "original"


def test_the_wrap_is_in_the_scheduler_patches():
    from vllm.v1.core.sched.scheduler import Scheduler

    names = [name for owner, name, _ in kvelastic_vllm.scheduler_patches() if owner is Scheduler]
    assert "_update_waiting_for_remote_kv" in names
