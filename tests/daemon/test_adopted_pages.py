"""A page a former daemon made, adopted from the keeper, is passed on to
workers as a copy of the keeper's descriptor when the backend cannot export
what it imported.

The CUDA driver exports only allocation handles its own process created: a
new daemon that imported a kept page and exported it again for a worker was
refused, so on a GPU an engine could not get a kept slab (found by the kit's
part 2 on an H200, 2026-12-04). There is no GPU here, so ``CudaRuleBackend``
stands in for the driver's rule over real memfd pages; the kit runs the real
one (``tests/daemon/test_keeper_daemon.py`` on CUDA pages)."""

from __future__ import annotations

import os

import pytest

from kvelastic.daemon.devices import Device
from kvelastic.vmm.base import Page
from kvelastic.vmm.host import HostBackend

MiB = 1 << 20


class CudaRuleBackend(HostBackend):
    """Memfd pages under CUDA's rule: ``export`` of an imported page fails."""

    exports_imported = False

    def __init__(self) -> None:
        super().__init__(2 * MiB)
        self.imported: set[int] = set()

    def import_page(self, fd: int) -> Page:
        page = super().import_page(fd)
        self.imported.add(id(page))
        return page

    def export(self, page: Page) -> int:
        if id(page) in self.imported:
            raise RuntimeError("cuMemExportToShareableHandle: CUDA_ERROR_INVALID_HANDLE (an imported handle)")
        return super().export(page)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def kept_page(value: int) -> int:
    """A page as the keeper holds it: a descriptor of memory another process made."""
    maker = HostBackend(2 * MiB)
    page = maker.create_page()
    os.pwrite(page.fd, bytes([value]), 0)
    fd = maker.export(page)
    maker.release_page(page)
    return fd


@pytest.mark.parametrize("backend", [CudaRuleBackend, lambda: HostBackend(2 * MiB)], ids=["cuda_rule", "host"])
def test_an_adopted_page_is_exported_as_a_copy_of_the_keepers_descriptor(backend):
    device = Device("0", backend(), 8 * MiB)
    before = open_fds()
    device.adopt(7, kept_page(42))
    sent = device.export(7)                                   # refused by the rule if re-exported
    try:
        assert os.pread(sent, 1, 0) == bytes([42])            # the kept bytes, not a new page
    finally:
        os.close(sent)
    device.release((7,))
    assert 7 not in device.pages and device.kept_fds == {}
    assert open_fds() == before                               # the keeper's descriptor closed with the page


def test_a_created_page_is_still_exported_by_the_backend():
    backend = CudaRuleBackend()
    device = Device("0", backend, 8 * MiB)
    assert device.create([1]) == [1]
    fd = device.export(1)
    os.close(fd)
    assert device.kept_fds == {}
    device.release((1,))


def test_a_failed_adoption_leaves_the_descriptor_to_the_caller():
    device = Device("0", CudaRuleBackend(), 8 * MiB)
    fd = os.memfd_create("not-a-page")                        # the wrong size: refused
    before = open_fds()
    with pytest.raises(Exception, match="not a"):
        device.adopt(3, fd)
    assert open_fds() == before and device.pages == {} and device.kept_fds == {}
    os.close(fd)
