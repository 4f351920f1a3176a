"""What makes two engines' cached blocks the same KV: the namespace and the
root of the block hashes.

Blocks are interchangeable only between engines that would compute the same
KV for the same tokens: same weights, dtype, KV layout and tenant. The
namespace names that; the daemon keys a secret hash seed on it, which the
plugin installs as vLLM's ``NONE_HASH`` (the parent of every first block), so
block hashes agree within a namespace on a node and cannot be predicted
outside it (vLLM's default sha256 root is a public constant).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from kvelastic_vllm.patching import keep_face

log = logging.getLogger("kvelastic.vllm")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Files whose content defines the model besides its weights (hashed whole: small).
CONFIG_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


def namespace_of(vllm_config: Any, block_stride: int, regions: int, num_workers: int, tenant_salt: str) -> str:
    """The namespace: a readable model name and a digest of everything that
    makes the KV of a token differ: the weights (``weights_fingerprint``), the
    model's settings as vLLM runs them (``effective_config``: the config
    files with any ``--hf-overrides``), how the KV bytes are computed
    (``kv_numerics``: compiled or eager, attention backend, parallel layout,
    speculative decoding), the KV cache's dtype and layout, the hash algorithm, the
    vLLM version (its hashed inputs may change between versions) and the
    tenant's salt."""
    import vllm

    model, cache = vllm_config.model_config, vllm_config.cache_config
    ident = "|".join(str(x) for x in (
        model.model, weights_fingerprint(str(model.model)), effective_config(model), kv_numerics(vllm_config),
        getattr(model, "revision", ""), model.dtype,
        getattr(model, "quantization", ""), cache.cache_dtype, cache.block_size, block_stride, regions,
        num_workers, getattr(cache, "prefix_caching_hash_algo", ""), vllm.__version__, tenant_salt))
    name = (os.path.basename(str(model.model).rstrip("/")) or "model")[:64]   # the daemon caps names at 128
    return f"{name}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def effective_config(model_config: Any) -> str:
    """The model's config as vLLM runs it: config.json with whatever the
    command line overrode (``--hf-overrides``: rope scaling, layer counts),
    which changes the KV of the same weights."""
    hf_config = getattr(model_config, "hf_config", None)
    try:
        text = hf_config.to_json_string(use_diff=False)   # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - not a transformers config, or not serialisable: its repr
        text = repr(hf_config)
    return hashlib.sha256(text.encode()).hexdigest()


def kv_numerics(vllm_config: Any) -> str:
    """The settings that change the KV bytes an engine writes for the same
    tokens and weights, though not what they mean: a compiled model fuses
    kernels differently from an eager one, attention backends and parallel
    layouts sum in other orders, speculative decoding verifies in other
    batch shapes. Greedy tokens can flip on such last-bit differences, so
    cache moves only between engines that compute it the same way. Only the
    settings as given: what vLLM fills in while compiling (seen custom ops,
    capture sizes) would differ between a cold start and a cached one."""
    compilation = vllm_config.compilation_config
    parallel = vllm_config.parallel_config
    attention = getattr(vllm_config, "attention_config", None)
    speculative = vllm_config.speculative_config
    pass_config = getattr(compilation, "pass_config", None)
    return "|".join(str(x) for x in (
        vllm_config.model_config.enforce_eager, int(compilation.mode or 0), compilation.backend,
        sorted(compilation.custom_ops or ()), pass_config.compute_hash() if pass_config is not None else "",
        getattr(attention, "backend", None), parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
        getattr(speculative, "method", None), getattr(speculative, "num_speculative_tokens", None)))


def weights_fingerprint(model: str) -> str:
    """A fingerprint of a local model folder's weights: each weight file's
    name, size and modification time, and the content of its config files.
    Cheap (no weight is read) and conservative: rewriting or copying a weight
    file changes it, so a cache is never served to weights that may differ.
    A model name that is not a local folder (a hub id) is resolved to its
    local snapshot, whose folder name is the revision's commit."""
    folder = local_folder(model)
    if folder is None:
        return "unresolved:" + model          # the name alone: the best identity there is
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(folder, followlinks=True)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if name.endswith(WEIGHT_SUFFIXES):
                st = os.stat(path)
                digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            elif name in CONFIG_FILES:
                with open(path, "rb") as f:
                    digest.update(rel.encode() + b"\0" + f.read())
    return digest.hexdigest()


def local_folder(model: str) -> str | None:
    """``model`` as a folder on this machine: itself, or a hub id's cached
    snapshot (never downloaded); None when neither."""
    if os.path.isdir(model):
        return os.path.realpath(model)
    try:   # a hub id: its snapshot on this machine, never a download
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True, allow_patterns=[])
    except Exception as exc:  # noqa: BLE001 - not cached here, or no hub client: fall back to the name
        log.debug("kvelastic: no local snapshot of %s: %s", model, exc)
        return None


class InitNoneHash(Protocol):
    """The shape of vLLM's ``init_none_hash`` (its argument is passed by name too)."""

    def __call__(self, hash_fn: Callable[[Any], bytes]) -> object: ...


def wrap_init_none_hash(original: InitNoneHash, seed: Callable[[], str]) -> InitNoneHash:
    """vLLM's ``init_none_hash`` (called once by EngineCore, after the KV cache
    is sized, so after this engine registered), then the root re-derived from
    the namespace's seed when the daemon gave one. vLLM's seed record
    (``_NONE_HASH_SEED``) is left alone: it is advertised to peers in clear."""

    @keep_face(original)
    def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
        original(hash_fn)
        secret = seed()
        if not secret:
            return
        import vllm.v1.core.kv_cache_utils as kv_cache_utils

        kv_cache_utils.NONE_HASH = kv_cache_utils.BlockHash(hash_fn(secret))
        log.info("kvelastic: block hashes rooted in this namespace's seed")

    return init_none_hash
