"""Every vLLM callable the plugin replaces, in one record.

vLLM reads its own callables' signatures: a utility call from the front end
(``LLM.collective_rpc``, ``reset_prefix_cache``, ``sleep``... in vLLM's
default layout, where the EngineCore runs in a process of its own) has its
arguments checked and converted against the called method's
``inspect.signature`` (``EngineCore._convert_msgspec_args``). A wrapper whose
signature is ``(self, *args, **kwargs)`` breaks every such call that carries
arguments. So each wrapper is made with ``keep_face``: the original's name,
qualified name, docstring, type hints and ``__wrapped__`` (which
``inspect.signature`` follows), and each installation goes through
``replace``, which records it for ``tests/vllm/test_signatures.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Replacement:
    """``owner.name`` was ``original`` and is now ``replacement``."""

    owner: Any
    name: str
    original: Any
    replacement: Any


# In installation order; ``restore`` takes them off in reverse.
INSTALLED: list[Replacement] = []


def keep_face(original: Callable[..., Any]) -> Callable[[F], F]:
    """Decorator for a wrapper of ``original``: it shows ``original``'s face
    (``functools.wraps``), so vLLM's signature checks see the original."""

    def face(wrapper: F) -> F:
        return cast(F, functools.wraps(original)(wrapper))

    return face


def replace(owner: Any, name: str, replacement: Any) -> Replacement:
    """Set ``owner.name`` to ``replacement`` and record it."""
    done = Replacement(owner, name, getattr(owner, name), replacement)
    setattr(owner, name, replacement)
    INSTALLED.append(done)
    return done


def restore(replaced: list[Replacement]) -> None:
    """Put back what ``replaced`` replaced (tests that run vLLM's scheduler in-process)."""
    for r in reversed(replaced):
        setattr(r.owner, r.name, r.original)
        if r in INSTALLED:
            INSTALLED.remove(r)
