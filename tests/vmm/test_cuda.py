"""CUDA backend: importable everywhere, one clear error without a GPU, and on a
GPU the same promises as host (memory really comes and goes, reservations are
free, views alias device memory).
"""

from __future__ import annotations

import importlib

import pytest

from kvelastic.vmm import DEFAULT_PAGE_SIZE, get_backend
from kvelastic.vmm.base import Backend
from kvelastic.vmm.errors import BackendUnavailable, CudaError
from tests.vmm.gpu import CUDA_OK, on_gpu
from tests.vmm.memio import pattern, read, write

PS = DEFAULT_PAGE_SIZE
N_BYTES = 4096


def test_import_never_needs_a_gpu() -> None:
    module = importlib.import_module("kvelastic.vmm.cuda")
    assert module.CudaBackend.name == "cuda"


@pytest.mark.skipif(CUDA_OK, reason="this machine has a usable CUDA GPU")
def test_cuda_without_gpu_is_one_clear_error() -> None:
    with pytest.raises(BackendUnavailable) as info:
        get_backend("cuda")
    message = str(info.value)
    assert "needs a usable CUDA GPU" in message and "KVELASTIC_BACKEND" in message
    assert "\n" not in message and info.value.reason == "backend_unavailable"
    assert get_backend("auto").name == "host"


def test_unknown_backend_name() -> None:
    with pytest.raises(BackendUnavailable, match="choose one of"):
        get_backend("tpu")


# --- on a GPU --------------------------------------------------------------
def _free_device_bytes() -> int:
    from cuda.bindings import driver

    err, free, _total = driver.cuMemGetInfo()
    assert not err
    return int(free)


@on_gpu
def test_auto_prefers_cuda() -> None:
    assert get_backend("auto").name == "cuda"


@on_gpu
def test_memory_is_given_back(cuda: Backend) -> None:
    n = 64  # 128 MiB: well above the driver's own bookkeeping noise
    free0 = _free_device_bytes()
    pages = [cuda.create_page() for _ in range(n)]
    arena = cuda.reserve(n * PS)
    for i, page in enumerate(pages):
        arena.map(i * PS, page)
    assert free0 - _free_device_bytes() >= n * PS
    for i in range(n):
        arena.unmap(i * PS)
    assert free0 - _free_device_bytes() >= n * PS  # the handles still hold it
    for page in pages:
        cuda.release_page(page)
    arena.close()
    assert free0 - _free_device_bytes() < n * PS // 4


@on_gpu
def test_large_reservation_costs_no_device_memory(cuda: Backend) -> None:
    free0 = _free_device_bytes()
    with cuda.reserve(64 << 30) as arena:
        assert free0 - _free_device_bytes() < 64 << 20
        page = cuda.create_page()
        arena.map(arena.size - PS, page)
        write(arena, arena.size - PS, pattern(1, 4096))
        assert read(arena, arena.size - PS, 4096) == pattern(1, 4096)
        assert free0 - _free_device_bytes() < PS + (64 << 20)
    cuda.release_page(page)


@on_gpu
def test_tensor_views_alias_device_memory(cuda: Backend) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no usable CUDA GPU for torch (CPU-only torch build)")
    page = cuda.create_page()
    with cuda.reserve(2 * PS) as arena:
        view = arena.tensor(torch.float16, (2, PS // 2), offset=0)  # built before any page is there
        arena.map(PS, page)
        assert view.device.type == "cuda" and view.data_ptr() == arena.base
        view[1].fill_(2.5)
        torch.cuda.synchronize()
        as_int = arena.tensor(torch.int16, (PS // 2,), offset=PS)
        assert bool((as_int == torch.tensor(2.5, dtype=torch.float16).view(torch.int16)).all())
        assert read(arena, PS, 2) == bytes(torch.tensor([2.5], dtype=torch.float16).view(torch.uint8).tolist())
        del view, as_int
    cuda.release_page(page)


@on_gpu
def test_a_thread_that_never_made_the_context_current_can_import_and_map(cuda: Backend) -> None:
    """What a worker's I/O thread does: import a descriptor, map, release, unmap."""
    import threading

    page = cuda.create_page()
    write_done: list[BaseException | None] = []
    with cuda.reserve(2 * PS) as arena:
        arena.map(0, page)
        write(arena, 0, pattern(11, N_BYTES))
        fd = cuda.export(page)

        def io_thread() -> None:
            try:
                twin = cuda.import_page(fd)
                arena.map(PS, twin)
                cuda.release_page(twin)          # the mapping keeps the memory
                write(arena, PS + N_BYTES, pattern(12, N_BYTES))
                write_done.append(None)
            except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                write_done.append(exc)

        thread = threading.Thread(target=io_thread)
        thread.start()
        thread.join(60)
        assert write_done == [None], write_done
        assert read(arena, PS, N_BYTES) == pattern(11, N_BYTES)       # same memory as slot 0
        assert read(arena, N_BYTES, N_BYTES) == pattern(12, N_BYTES)  # and the other way round
        unmapper = threading.Thread(target=arena.unmap, args=(PS,))
        unmapper.start()
        unmapper.join(60)
        assert not arena.is_mapped(PS) and arena.is_mapped(0)
    cuda.release_page(page)


@on_gpu
def test_zero_really_zeroes_every_byte(cuda: Backend) -> None:
    from cuda.bindings import driver

    page = cuda.create_page()
    with cuda.reserve(PS) as arena:
        arena.map(0, page)
        (err,) = driver.cuMemsetD8(arena.base, 0xAB, PS)
        assert not err
        assert read(arena, PS - 16, 16) == b"\xab" * 16
        arena.unmap(0)
        cuda.zero(page)
        arena.map(0, page)
        assert read(arena, 0, PS) == bytes(PS)
    cuda.release_page(page)


@on_gpu
def test_a_view_keeps_the_range_reserved_after_close(cuda: Backend) -> None:
    import gc
    import weakref

    import torch

    if not torch.cuda.is_available():
        pytest.skip("no usable CUDA GPU for torch (CPU-only torch build)")
    page = cuda.create_page()
    arena = cuda.reserve(4 * PS)
    arena.map(2 * PS, page)
    view = arena.tensor(torch.int32, (4 * PS // 4,))          # starts on an unmapped page
    view[PS // 2:PS // 2 + 4].fill_(7)
    assert view[PS // 2:PS // 2 + 4].tolist() == [7, 7, 7, 7]
    reservation = weakref.ref(arena._reservation)            # type: ignore[attr-defined]
    arena.close()
    gc.collect()
    assert reservation() is not None, "a live view must keep the addresses reserved"
    del view
    gc.collect()
    assert reservation() is None, "the range is given back once the last view is gone"
    cuda.release_page(page)


@on_gpu
def test_driver_errors_carry_their_name(cuda: Backend) -> None:
    import os

    fd = os.memfd_create("not-a-cuda-page")
    try:
        with pytest.raises(CudaError) as info:
            cuda.import_page(fd)
        assert info.value.name.startswith("CUDA_ERROR_") and info.value.name in str(info.value)
        os.fstat(fd)  # a failed import leaves the descriptor with the caller
    finally:
        os.close(fd)


def test_format_uuid_is_nvidia_smis_form() -> None:
    from kvelastic.vmm.cuda import format_uuid

    assert format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


@on_gpu
def test_the_gpus_uuid_is_the_one_torch_and_the_plugin_name_it_by(cuda: Backend) -> None:
    """Workers name their GPU by UUID (``kvelastic_vllm.worker.daemon_device``:
    torch's device properties), the daemon knows each of its devices by it too
    (``CudaBackend.uuid``: the driver): the two must agree."""
    import torch

    mine = cuda.uuid()  # type: ignore[attr-defined]
    seen = str(torch.cuda.get_device_properties(cuda.device).uuid)  # type: ignore[attr-defined]
    assert mine == (seen if seen.startswith("GPU-") else f"GPU-{seen}"), (mine, seen)
