"""The other process of the hand-off test (``python -m tests.vmm.peer SOCKET BACKEND``).

It connects to the page channel, imports the pages it receives, maps them into
its own arena in reverse order, checks what the parent wrote (through torch
views on host), overwrites it with its own pattern, and prints one JSON line.
"""

from __future__ import annotations

import json
import sys

from kvelastic.vmm import get_backend
from kvelastic.vmm.fdchannel import FdChannel
from tests.vmm.memio import pattern, read, write

SPAN = 64 * 1024  # bytes checked at each end of a page


def main(path: str, backend_name: str) -> int:
    backend = get_backend(backend_name)
    ps = backend.page_size
    with FdChannel.connect(path) as channel:
        received = channel.recv()
    pages = {page_id: backend.import_page(fd) for page_id, fd in received}
    ids = sorted(pages)
    seen = []
    with backend.reserve(len(ids) * ps) as arena:
        for slot, page_id in enumerate(reversed(ids)):
            arena.map(slot * ps, pages[page_id])
        for slot, page_id in enumerate(reversed(ids)):
            base = slot * ps
            head = read(arena, base, SPAN) == pattern(page_id, SPAN)
            tail = read(arena, base + ps - SPAN, SPAN) == pattern(page_id + 1, SPAN)
            seen.append(head and tail)
            write(arena, base, pattern(page_id + 50, SPAN))
    for page in pages.values():
        backend.release_page(page)
    print(json.dumps({"ids": ids, "seen": seen}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
