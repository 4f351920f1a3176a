"""Pages cross a process boundary: written in one process, read in another.

The parent creates pages, writes through its own arena, and hands them over
the page channel (SCM_RIGHTS) to a separate Python process, which imports and
maps them, checks the bytes and writes back; the parent then sees the child's
writes through its own mappings. Same memory, two processes, no copies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvelastic.vmm.base import Backend
from kvelastic.vmm.fdchannel import FdChannel, listen
from tests.vmm.memio import pattern, read, write
from tests.vmm.peer import SPAN

ROOT = Path(__file__).resolve().parents[2]


def test_pages_written_here_are_read_in_another_process(backend: Backend, tmp_path) -> None:
    ps = backend.page_size
    ids = [101, 102, 103]
    path = str(tmp_path / "pages.sock")
    listener = listen(path)
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.vmm.peer", path, backend.name],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pages = [backend.create_page() for _ in ids]
    try:
        with backend.reserve(len(ids) * ps) as arena:
            for slot, (page_id, page) in enumerate(zip(ids, pages)):
                arena.map(slot * ps, page)
                write(arena, slot * ps, pattern(page_id, SPAN))
                write(arena, slot * ps + ps - SPAN, pattern(page_id + 1, SPAN))

            listener.settimeout(60)
            with FdChannel.accept(listener) as channel:
                exported = [backend.export(page) for page in pages]
                channel.send(list(zip(ids, exported)))
                for fd in exported:  # the peer holds its own copies now
                    os.close(fd)
            out, err = child.communicate(timeout=120)
            assert child.returncode == 0, err
            report = json.loads(out.strip().splitlines()[-1])
            assert report == {"ids": ids, "seen": [True, True, True]}

            # The child's writes are visible through this process's mappings.
            for slot, page_id in enumerate(ids):
                assert read(arena, slot * ps, SPAN) == pattern(page_id + 50, SPAN)
                assert read(arena, slot * ps + ps - SPAN, SPAN) == pattern(page_id + 1, SPAN)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        listener.close()
        for page in pages:
            backend.release_page(page)
