"""The memory backend of the tests that run a real daemon with real workers.

``KVELASTIC_TEST_BACKEND`` is read here and nowhere else: ``host`` (memfd
pages, the default, what CI runs) or ``cuda`` (CUDA VMM pages on GPU 0, what
``make gpu-check`` sets on a GPU machine). The daemon (``tests/daemon_proc.py``)
and the workers of the engine processes (``tests/daemon/peer.py``) both use it,
so one set of flow tests proves both backends instead of a copy per backend.
"""

from __future__ import annotations

import os

TEST_BACKENDS = ("host", "cuda")
TEST_BACKEND = os.environ.get("KVELASTIC_TEST_BACKEND", "host") or "host"
if TEST_BACKEND not in TEST_BACKENDS:
    raise RuntimeError(f"KVELASTIC_TEST_BACKEND={TEST_BACKEND!r}: choose one of {', '.join(TEST_BACKENDS)}")
