"""LoRA adapters keyed by their content, not their name and path.

vLLM puts a LoRA request's name and path in its blocks' hashes. Within one
engine's life that is enough (its workers load an adapter id once), but kept
cache outlives the engine: an adapter retrained and written over the same
folder, or another adapter under a reused name and path, would meet the old
adapter's blocks in the next engine. The plugin adds a fingerprint of the
adapter's files (every file's content, hashed once per adapter id and
process) to the hash, so blocks of two adapters match only when their files
are byte for byte the same.

An adapter that cannot be read here (a hub id with no local snapshot) gets a
random fingerprint: its blocks stay this engine's own, never matched by
another. The fingerprint is taken when the engine first hashes a request of
that adapter, before its workers load it; files rewritten in between are
the one window, as for vLLM's own name-and-path key.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

from kvelastic_vllm.identity import local_folder
from kvelastic_vllm.patching import keep_face

log = logging.getLogger("kvelastic.vllm")
_CHUNK = 1 << 20


class AdapterFingerprints:
    """Fingerprints by (adapter id, name, path), for this process's life; an
    adapter removed from the engine (``forget``) is read again if it returns."""

    def __init__(self, read: Callable[[str], str] | None = None) -> None:
        self._read = read or adapter_fingerprint
        self._known: dict[tuple[int, str, str], str] = {}
        self._lock = threading.Lock()

    def of(self, lora_id: int, name: str, path: str) -> str:
        key = (lora_id, name, path)
        found = self._known.get(key)
        if found is None:
            found = self._read(path)
            with self._lock:
                found = self._known.setdefault(key, found)
            log.info("kvelastic: LoRA adapter %s (id %d) keyed by its content %s", name, lora_id, found[:16])
        return found

    def forget(self, lora_id: int) -> None:
        with self._lock:
            for key in [k for k in self._known if k[0] == lora_id]:
                del self._known[key]


def adapter_fingerprint(path: str) -> str:
    """sha256 over every file of the adapter's folder (relative name and content)."""
    folder = local_folder(path)
    if folder is None:
        return "unreadable:" + secrets.token_hex(16)
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(folder, followlinks=True)):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            digest.update(os.path.relpath(full, folder).encode() + b"\0")
            with open(full, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
            digest.update(b"\0")
    return digest.hexdigest()


FINGERPRINTS = AdapterFingerprints()


def wrap_lora_extra_hash_keys(original: Callable[[Any], list], fingerprints: AdapterFingerprints = FINGERPRINTS):
    """vLLM's ``_gen_lora_extra_hash_keys`` (name and path), plus the content."""

    @keep_face(original)
    def gen_lora_extra_hash_keys(request: Any) -> list:
        keys = original(request)
        lora = request.lora_request
        if not lora or not keys:
            return keys
        content = fingerprints.of(lora.lora_int_id, lora.lora_name, lora.lora_path)
        first = keys[0]
        # vLLM 0.31+: [("lora", name, path)]; vLLM 0.29/0.30: [name]
        return [(*first, content) if isinstance(first, tuple) else (first, content), *keys[1:]]

    return gen_lora_extra_hash_keys


def wrap_remove_lora(original: Callable[..., bool], fingerprints: AdapterFingerprints = FINGERPRINTS):
    """An adapter removed from the engine may come back with other files."""

    @keep_face(original)
    def remove_lora(self: Any, lora_id: int) -> bool:
        fingerprints.forget(lora_id)
        return original(self, lora_id)

    return remove_lora
