"""Run as a script (a process of its own: the plugin patches vLLM for good):
enable the plugin, install every patch, and print as JSON, for each vLLM
callable it replaced, how the replacement's face differs from the original's.

    KVELASTIC_ENABLE=1 python tests/vllm/signatures.py

A wrapper must keep the original's signature, name, qualified name and type
hints (vLLM checks a utility call's arguments against the called method's
``inspect.signature``). A class that stands in for vLLM's (``ElasticBlockPool``
for ``BlockPool``) must take what the original's constructor and every method
it overrides take: the same parameters first, of the same kinds and
defaults, for every caller in vLLM (its own annotations may name looser
types; a parameter it adds has a default).
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any


def face(fn: Any) -> dict[str, Any]:
    sig = inspect.signature(fn)
    return {"name": getattr(fn, "__name__", None), "qualname": getattr(fn, "__qualname__", None),
            "signature": str(sig), "hints": {k: str(v) for k, v in inspect.get_annotations(fn).items()}}


def callers_view(fn: Any) -> list[tuple[str, str, str]]:
    """What a caller binds to: each parameter's name, kind and default."""
    return [(p.name, p.kind.name, repr(p.default)) for p in inspect.signature(fn).parameters.values()]


def wrapper_mismatches(original: Any, replacement: Any) -> list[str]:
    a, b = face(original), face(replacement)
    return [f"{key}: {a[key]!r} became {b[key]!r}" for key in a if a[key] != b[key]]


def takes_what_it_took(original: Any, replacement: Any) -> bool:
    """Every call that binds to ``original`` binds to ``replacement`` alike:
    the original's parameters come first, in order, of the same kinds and
    defaults; any added one has a default."""
    old, new = callers_view(original), callers_view(replacement)
    return new[:len(old)] == old and all(default != repr(inspect.Parameter.empty)
                                         or kind.startswith("VAR_") for _, kind, default in new[len(old):])


def class_mismatches(original: type, replacement: type) -> list[str]:
    out = []
    if not takes_what_it_took(original, replacement):
        out.append(f"constructor: {inspect.signature(original)} became {inspect.signature(replacement)}")
    for name, attr in vars(replacement).items():
        base = inspect.getattr_static(original, name, None)
        if name.startswith("__") or not callable(attr) or not callable(base):
            continue
        if not takes_what_it_took(base, attr):
            out.append(f"{name}: {inspect.signature(base)} became {inspect.signature(attr)}")
    return out


def mismatches(original: Any, replacement: Any) -> list[str]:
    if isinstance(original, type):
        return class_mismatches(original, replacement)
    return wrapper_mismatches(original, replacement)


def main() -> None:
    import kvelastic_vllm
    from kvelastic_vllm.block_pool import ElasticBlockPool
    from kvelastic_vllm.patching import INSTALLED

    kvelastic_vllm.register()
    report = {f"{getattr(r.owner, '__name__', r.owner)}.{r.name}": mismatches(r.original, r.replacement)
              for r in INSTALLED}

    # The hooks an admission puts on one manager for a step (``demand.hear``)
    # replace vLLM callables too: on a stand-in manager, then compared.
    import vllm.v1.core.kv_cache_coordinator as coordinator
    import vllm.v1.core.kv_cache_manager as manager

    from kvelastic_vllm import demand

    class Pool:
        pass

    pool = Pool()
    pool.demand = demand.Demand()

    mgr = object.__new__(manager.KVCacheManager)
    mgr.coordinator = object.__new__(coordinator.UnitaryKVCacheCoordinator)
    demand.hear(mgr, pool)
    report["KVCacheManager.allocate_slots (heard)"] = mismatches(
        manager.KVCacheManager.allocate_slots, mgr.allocate_slots.__func__)
    report["KVCacheCoordinator.get_num_blocks_to_allocate (heard)"] = mismatches(
        coordinator.KVCacheCoordinator.get_num_blocks_to_allocate, mgr.coordinator.get_num_blocks_to_allocate.__func__)

    # The check itself, on wrappers that drop the face: it must see them.
    original = type(mgr).allocate_slots

    def bare(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    renamed = functools.wraps(original)(lambda self, *a, **k: None)
    renamed.__name__ = "renamed"
    report["control: a bare wrapper"] = mismatches(original, bare)
    report["control: a renamed wrapper"] = mismatches(original, renamed)
    report["control: a narrower block pool"] = mismatches(ElasticBlockPool.__mro__[1], type(
        "Narrow", (ElasticBlockPool,), {"get_new_blocks": lambda self: None}))
    print("RESULT " + json.dumps({"installed": len(INSTALLED), "report": report}))


if __name__ == "__main__":
    main()
