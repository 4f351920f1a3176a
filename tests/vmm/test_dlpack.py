"""The DLPack path that CUDA arenas build their tensors with, proven on host memory.

The same ctypes structures, capsule and deleter serve ``KDL_CUDA``; only the
device field differs, so what holds here (aliasing, dtype views, the keepalive
living exactly as long as the last tensor) holds for the GPU path too.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvelastic.vmm import _dlpack
from kvelastic.vmm.base import Backend
from tests.vmm.memio import pattern, read, write


class _Keep:
    """Stands in for an arena's reservation."""


def test_a_dlpack_tensor_aliases_arena_memory(host: Backend) -> None:
    ps = host.page_size
    page = host.create_page()
    with host.reserve(2 * ps) as arena:
        arena.map(ps, page)
        write(arena, ps, pattern(3, 4096))
        keep = _Keep()
        raw = _dlpack.tensor_at(arena.base + ps, ps, _dlpack.KDL_CPU, 0, keep)
        assert raw.dtype == torch.uint8 and raw.shape == (ps,) and raw.data_ptr() == arena.base + ps
        assert bytes(raw[:4096].tolist()) == pattern(3, 4096)
        as_f32 = raw.view(torch.float32).as_strided((4, 8), (8, 1))
        as_f32.fill_(1.5)
        assert read(arena, ps, 4) == bytes(torch.tensor([1.5]).view(torch.uint8).tolist())
        del raw, as_f32
    host.release_page(page)


def test_the_keepalive_lives_exactly_as_long_as_the_last_view() -> None:
    buf = bytearray(256)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    before = _dlpack.alive()
    keep = _Keep()
    ref = weakref.ref(keep)
    t = _dlpack.tensor_at(base, 256, _dlpack.KDL_CPU, 0, keep)
    view = t[128:].view(torch.int32)          # shares the storage
    del keep
    t[128] = 9
    assert buf[128] == 9
    del t
    gc.collect()
    assert ref() is not None and _dlpack.alive() == before + 1, "a derived view still holds the storage"
    del view
    gc.collect()
    assert ref() is None and _dlpack.alive() == before, "the deleter ran when the last view died"


def test_many_tensors_leave_nothing_behind() -> None:
    buf = bytearray(4096)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    before = _dlpack.alive()
    for i in range(2000):
        t = _dlpack.tensor_at(base + (i % 64), 64, _dlpack.KDL_CPU, 0, None)
        t.add_(1)
    del t
    gc.collect()
    assert _dlpack.alive() == before
    assert sum(buf[:128]) > 0


@pytest.mark.parametrize(("ptr", "nbytes"), [(0, 16), (4096, 0), (4096, -1)])
def test_bad_ranges_are_refused(ptr: int, nbytes: int) -> None:
    before = _dlpack.alive()
    with pytest.raises(ValueError):
        _dlpack.tensor_at(ptr, nbytes, _dlpack.KDL_CPU, 0, None)
    assert _dlpack.alive() == before
