"""Valid wire values of any protocol type, built from its type information.

Why generic: the fuzzer (``kvelastic_tools.fuzz``) must cover every message type
and every field, including those added after it was written (an engine's
``token``), so values come from ``msgspec.inspect`` (fields, bounds, unions,
nested structs), never from per-type code. Values are plain dicts and lists
(what msgpack carries), so that one place can then be broken on purpose; each
such place is recorded as a ``Slot``.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import msgspec.inspect as mi

from kvelastic import protocol as p

# Mostly small or meaningful numbers (the version, a 2 MiB page size), so that
# some messages get past the daemon's first checks.
FRIENDLY_INTS = (0, 1, 2, 3, 4, 8, p.PROTOCOL_VERSION, 2 << 20, 4096)
NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789-_."
# Few names, so that a message often names an engine an earlier one registered
# (what reaches the allocator past "unknown engine").
NAME_POOL = 256
_KIND = {bool: "bool", float: "float", bytes: "bytes", str: "str", list: "list", dict: "dict"}


@dataclasses.dataclass
class Slot:
    """One place in a built message that a kind may break: ``parent[key]``
    (``kind`` "key_str"/"key_int": the dict key ``key`` itself)."""

    parent: Any
    key: Any
    kind: str


class ValueBuilder:
    """Builds one valid value of a ``msgspec.inspect`` type as plain msgpack-able
    data (dicts and lists, so it can be broken afterwards), noting its slots."""

    def __init__(self, rng: random.Random, avoid: frozenset[str], names: dict[tuple, list[str]]) -> None:
        self.rng, self.avoid, self.names = rng, avoid, names
        self.slots: list[Slot] = []

    def build(self, t: mi.Type, parent: Any, key: Any) -> Any:
        rng = self.rng
        if isinstance(t, mi.IntType):
            self.slots.append(Slot(parent, key, "int"))
            return self._int(t)
        if isinstance(t, mi.StrType):
            self.slots.append(Slot(parent, key, "str"))
            return self._name(t.min_length or 0, t.max_length)
        if isinstance(t, (mi.BytesType, mi.ByteArrayType)):
            self.slots.append(Slot(parent, key, "bytes"))
            return rng.randbytes(rng.randint(t.min_length or 0, min(t.max_length or 16, 16)))
        if isinstance(t, mi.BoolType):
            self.slots.append(Slot(parent, key, "bool"))
            return rng.random() < 0.5
        if isinstance(t, mi.FloatType):
            self.slots.append(Slot(parent, key, "float"))
            return rng.random() * 1e3
        if isinstance(t, mi.StructType):
            return self.struct(t, parent, key)
        if isinstance(t, mi.UnionType):
            return self.build(rng.choice(t.types), parent, key)
        if isinstance(t, (mi.LiteralType, mi.EnumType)):
            values = t.values if isinstance(t, mi.LiteralType) else [m.value for m in t.cls]
            return rng.choice(list(values))
        if isinstance(t, mi.TupleType):
            out: list[Any] = []
            self.slots.append(Slot(parent, key, "list"))
            out.extend(self.build(item, out, i) for i, item in enumerate(t.item_types))
            return out
        if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
            self.slots.append(Slot(parent, key, "list"))
            out = []
            nested = isinstance(t.item_type, mi.StructType)   # a status's engines: one is enough
            for i in range(self._length(t.min_length, 1 if nested else t.max_length)):
                out.append(self.build(t.item_type, out, i))
            return out
        if isinstance(t, (mi.DictType, mi.FrozenDictType)):
            self.slots.append(Slot(parent, key, "dict"))
            d: dict[Any, Any] = {}
            for _ in range(self._length(t.min_length, t.max_length)):
                k = self._int(t.key_type) if isinstance(t.key_type, mi.IntType) else \
                    self._name(1, getattr(t.key_type, "max_length", None))
                d[k] = self.build(t.value_type, d, k)
                self.slots.append(Slot(d, k, "key_int" if isinstance(k, int) else "key_str"))
            return d
        if isinstance(t, mi.NoneType):
            return None
        return self._int(mi.IntType())     # Any and the rest: a small int (the unit test checks validity)

    def struct(self, t: mi.StructType, parent: Any, key: Any, hints: dict[str, Any] | None = None) -> Any:
        """A struct as the wire carries it: a map (or an array when array-like)
        with its tag; optional fields are left out half the time. ``hints``:
        values for some fields (what this daemon accepts: its page size, a
        version), so that some messages get past its first checks."""
        rng = self.rng
        self.slots.append(Slot(parent, key, "list" if t.array_like else "dict"))
        if t.array_like:
            arr: list[Any] = [t.tag] if t.tag_field is not None else []
            if t.tag_field is not None:
                self.slots.append(Slot(arr, 0, "str"))
            for f in t.fields:
                arr.append(None)
                arr[-1] = self.build(f.type, arr, len(arr) - 1)
            return arr
        d: dict[str, Any] = {}
        if t.tag_field is not None:
            d[t.tag_field] = t.tag
            self.slots.append(Slot(d, t.tag_field, "str"))
        for f in t.fields:
            if hints and f.encode_name in hints:
                value = hints[f.encode_name]          # a copy: what a kind breaks must not stay broken
                value = d[f.encode_name] = copy.deepcopy(value) if isinstance(value, (list, dict)) else value
                self.slots.append(Slot(d, f.encode_name, _KIND.get(type(value), "int")))
            elif f.required or rng.random() < 0.5:
                d[f.encode_name] = self.build(f.type, d, f.encode_name)
            else:
                continue
            self.slots.append(Slot(d, f.encode_name, "key_str"))
        return d

    def _int(self, t: mi.IntType) -> int:
        rng = self.rng
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
        v = rng.choice(FRIENDLY_INTS) if rng.random() < 0.7 else rng.randint(-5, 1 << 20)
        v = max(v, lo) if lo is not None else v
        return min(v, hi) if hi is not None else v

    def _length(self, lo: int | None, hi: int | None) -> int:
        return self.rng.randint(lo or 0, max(lo or 0, min(hi if hi is not None else 3, 3)))

    def _name(self, lo: int, hi: int | None) -> str:
        """A short random name from a pool per bound (fresh names cost more
        than the rest of a message); never one of ``avoid``."""
        pool = self.names.get((lo, hi))
        if pool is None:
            pool = self.names[(lo, hi)] = names(lo, hi, self.avoid)
        return pool[int(self.rng.random() * NAME_POOL)]


def names(lo: int, hi: int | None, avoid: frozenset[str], seed: int = 0) -> list[str]:
    """``NAME_POOL`` names of ``lo``..``hi`` (at most 12) characters. The same
    for every fuzzer of a ``seed``: page-channel hellos and control messages
    from different fuzzers name the same engines."""
    rng = random.Random(f"{seed}/{lo}/{hi}")
    pool: list[str] = []
    while len(pool) < NAME_POOL:
        n = rng.randint(max(lo, 1 if lo else 0), max(lo, min(hi if hi is not None else 12, 12)))
        name = "".join(rng.choices(NAME_CHARS, k=n))
        if name not in avoid:
            pool.append(name)
    return pool


# ------------------------------------------------- hostile but valid values
# Type-valid values at the edges of what a field can mean: every one decodes
# (where the protocol bounds a field, as a rank, a value past the bound is
# a refusal of its own), and a daemon must refuse it or live with it, whatever
# it costs to compute with. The sequence fuzzer (``kvelastic_tools.fuzz.Sequences``)
# puts them in otherwise well-formed registrations, grows, journals and hellos.
def hostile_ints(page_size: int, budget_bytes: int) -> dict[str, tuple[int, ...]]:
    """Field name -> its extreme values, for a daemon of ``page_size`` pages
    and a ``budget_bytes`` device budget."""
    pages = max(1, budget_bytes // page_size)
    big = (2**31 - 1, 2**40, 2**62, 2**63 - 1)
    return {
        "blocks_per_slab": (1, 3, 2**20, 2**31, 2**40, 2**62),
        "block_bytes": (1, 3, page_size + 1, 2**40),
        "pages_per_worker": (2, pages, pages + 1, 2**20, 2**40),
        "pages_per_region": (0, -1, 2, 3, pages, 2**40),
        "num_workers": (3, 64, 1023, 1024, 2**31),
        "min_bytes": (1, page_size, budget_bytes - page_size, budget_bytes, budget_bytes + 1, 2**62),
        "max_bytes": (1, page_size - 1, page_size, budget_bytes, 2**63 - 1),
        "block_tokens": (1, 2**20, 2**40, 2**63 - 1, -1),
        "pid": (0, 1, -1, 2**31 - 1, -(2**63)),
        # A hello's or a worker's rank: -1 is the engine's lifeline, below it nothing.
        "rank": (-1, -2, -3, -(2**31), -(2**63), 1023, 1024, 2**31, 2**63 - 1),
        "slab": (2**20, 2**31, *big),
        "block": (2**31, *big),
        "step": (2**31, 2**62, 2**63 - 1),
        "grow": (4096, 4097, 2**31, 2**63 - 1),
        "stat": (-1, -(2**63), 2**63 - 1),
        "offset": (2**20, 2**40, 2**62),
    }
