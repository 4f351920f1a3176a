"""The placeholder kernel ops of the kernel-free vLLM bundle (see vllmbundle.py).

vLLM's CUDA build registers its kernels in ``torch.ops._C`` from
``vllm/_C_stable_libtorch.abi3.so``, which the bundle leaves out. Some of vLLM's
Python names those ops without calling them on the bundle's path (torch-native
custom ops, Triton attention), and fails with AttributeError if they are absent:

- layer ops: activation layers look their kernel up in ``__init__``
  (model_executor/layers/activation.py: ``self.op = torch.ops._C.silu_and_mul``)
  even when custom_ops=none sends ``forward`` to ``forward_native``;
- compile-path ops (enforce_eager=False): compilation/passes/pass_manager.py
  imports every CUDA fusion pass at module level, and those modules build their
  pattern tables from ``torch.ops._C.<op>.default`` (fusion/matcher_utils.py:32 ...);
  the always-on FixFunctionalizationPass compares every auto-functionalized node
  of a graph with them (utility/fix_functionalization.py:40, 98-170);
- capability queries that modules call at import (quantization/utils/w8a8_utils.py:41).

The stub defines each op with its real schema, read from the ``.so``; a
placeholder raises, naming the op, if it is ever called (under tracing too:
the implementation is CompositeExplicitAutograd, which Meta/fake dispatch reaches),
and a query answers False. Ops that vLLM checks with ``hasattr`` before use
(``per_token_group_fp8_quant``, ``scaled_fp4_quant`` ...) stay undefined, so vLLM's
own check answers "not available". ``compile_path_handles`` reads vLLM's
compilation sources and the builder checks that ``COMPILE_OPS`` is exactly the
set they name unguarded, so a new vLLM release cannot add one silently.

Which compiled passes run with the bundle's engine arguments (vLLM 0.32's -O2
defaults, config/vllm.py OPTIMIZATION_LEVEL_02, on CUDA, Llama, TP=1, unquantized,
custom_ops none, native IR ops): see ``COMPILED_PASSES``.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

LAYER_WHY = ("looked up, not called, in the layer's __init__ (model_executor/layers/activation.py) on CUDA; "
             "custom_ops=none runs forward_native")
# Activation ops that CustomOp subclasses look up in __init__ on CUDA (``self.op = torch.ops._C.silu_and_mul``).
EAGER_OPS = ("silu_and_mul", "mul_and_silu", "fatrelu_and_mul", "situ_and_mul", "silu_and_mul_with_clamp",
             "gelu_and_mul", "gelu_tanh_and_mul", "gelu_new", "gelu_fast", "gelu_quick", "swigluoai_and_mul")

# Ops that vllm/compilation names without a hasattr check (every site is listed in the manifest, read from the
# wheel). Fusion-pass tables: used only by passes that the bundle's configuration leaves off (COMPILED_PASSES);
# FixFunctionalizationPass (always on) only compares graph nodes with them, and with native ops no graph holds one.
_TABLE = "pattern table of a fusion pass, built when compilation/passes/pass_manager.py imports it on CUDA"
_FIX = "FixFunctionalizationPass.__call__ (always on) compares each auto-functionalized node with it"
COMPILE_OPS = {
    "silu_and_mul": f"{_TABLE} (matcher_utils, act_quant_fusion); {_FIX}",
    "rotary_embedding": f"{_TABLE} (matcher_utils); FixFunctionalizationPass.__call__ puts it in its rope "
                        "targets on every run; scatter_split_replace",
    "static_scaled_fp8_quant": f"{_TABLE} (matcher_utils, rms_quant_fusion QUANT_OPS)",
    "dynamic_scaled_fp8_quant": f"{_TABLE} (matcher_utils, rms_quant_fusion QUANT_OPS)",
    "dynamic_per_token_scaled_fp8_quant": f"{_TABLE} (matcher_utils, rms_quant_fusion QUANT_OPS)",
    "fused_add_rms_norm": f"{_TABLE} (rms_quant_fusion RMS_ADD_OP); {_FIX}",
    "rms_norm_static_fp8_quant": f"{_TABLE} (rms_quant_fusion FUSED_OPS); {_FIX}",
    "fused_add_rms_norm_static_fp8_quant": f"{_TABLE} (rms_quant_fusion FUSED_OPS); {_FIX}",
    "rms_norm_dynamic_per_token_quant": f"{_TABLE} (rms_quant_fusion FUSED_OPS); {_FIX}",
    "silu_and_mul_quant": f"{_TABLE} (act_quant_fusion FUSED_OPS); {_FIX}",
    "silu_and_mul_per_block_quant": f"{_TABLE} (act_quant_fusion FUSED_OPS, on CUDA-alike without a hasattr check)",
    "fused_qk_norm_rope": f"{_TABLE} (qk_norm_rope_fusion FUSED_QK_ROPE_OP); {_FIX}",
    "rms_norm": _FIX,
}
# Where vLLM asks whether a stubbed op exists, and why the answer now being yes changes nothing on the bundle's path.
CHECKED_STUBS = {
    "static_scaled_fp8_quant": "fusion/rope_kvcache_fusion.py:39 getattr(torch.ops._C, ...) feeds only "
                               "RopeKVCacheFusionPass.__init__, a ROCm/AITER-only pass (fuse_rope_kvcache is off)",
}

# Capability queries that modules call at import (quantization/utils/w8a8_utils.py:41
# ``CUTLASS_BLOCK_FP8_SUPPORTED = cutlass_block_fp8_supported()``): without the kernels the answer is False.
QUERY_OPS = ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8", "cutlass_scaled_mm_supports_fp4",
             "cutlass_group_gemm_supported", "mxfp4_experts_quant_supported")
QUERY_WHY = "called at import (quantization/utils/w8a8_utils.py, quantization kernels); answers False"

# The compiled path's passes with the bundle's engine arguments, as vLLM 0.32 decides them; the rehearsal
# (PostGradPassManager.configure on a CUDA VllmConfig, NVML faked) printed exactly these.
COMPILED_PASSES = {
    "run": ["NoOpEliminationPass", "PostCleanupPass", "VllmIRLoweringPass", "UnsafeCloneEliminationPass",
            "FixFunctionalizationPass"],
    "off": {
        "fuse_norm_quant": "enable_norm_fusion: rms_norm and quant_fp8 custom ops off and rms_norm IR priority "
                           "native, so the graph holds no kernel to fuse (Inductor fuses the native ops itself)",
        "fuse_act_quant": "enable_act_fusion: silu_and_mul and quant_fp8 custom ops off, model not NVFP4",
        "fuse_allreduce_rms": "enable_allreduce_rms_fusion: tensor_parallel_size 1 (and no flashinfer)",
        "fuse_attn_quant": "IS_QUANTIZED is False in 0.32 (config/vllm.py)",
        "fuse_act_padding": "enable_norm_pad_fusion: fused_add_rms_norm IR priority is native, not aiter",
        "fuse_mla_dual_rms_norm": "ROCm/AITER only",
        "fuse_rope_kvcache": "ROCm/AITER only",
        "fuse_qk_norm_rope_kvcache": "ROCm/AITER only",
        "fuse_rope_kvcache_cat_mla": "enable_rope_kvcache_mla_fusion: splitting_ops default to the KV-cache "
                                     "update ops (splitting_ops_contain_kv_cache_update), and Llama has no MLA",
        "enable_qk_norm_rope_fusion": "False at every optimization level in 0.32",
    },
}

_HANDLE = re.compile(r"torch\.ops\._C\.(\w+)")
_CHECK = re.compile(r"(?:hasattr|getattr)\(\s*torch\.ops\._C\s*,\s*[\"'](\w+)[\"']")


def compile_path_handles(sources: dict[str, str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """From ``{path: source}`` of vllm/compilation: the ``_C`` ops named without a hasattr/getattr check of that op
    in the same file (op -> ["file:line", ...]), and those named only behind one (left undefined on purpose)."""
    plain: dict[str, list[str]] = {}
    guarded: dict[str, list[str]] = {}
    for path, text in sorted(sources.items()):
        checked = set(_CHECK.findall(text))
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            for name in _HANDLE.findall(line):
                (guarded if name in checked else plain).setdefault(name, []).append(f"{path}:{lineno}")
    return plain, {n: s for n, s in guarded.items() if n not in plain}


def capability_checks(sources: dict[str, str], names: set[str]) -> dict[str, list[str]]:
    """Where ``hasattr``/``getattr(torch.ops._C, name)`` asks for one of ``names`` (op -> ["file:line", ...])."""
    found: dict[str, list[str]] = {}
    for path, text in sorted(sources.items()):
        for m in _CHECK.finditer(text):
            if m.group(1) in names:
                found.setdefault(m.group(1), []).append(f"{path}:{text.count(chr(10), 0, m.start()) + 1}")
    return found


def op_schemas(wheel: Path, names: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The schemas of ``names`` as the real ``_C_stable_libtorch`` registers them (strings in the .so)."""
    with zipfile.ZipFile(wheel) as zf:
        blob = zf.read("vllm/_C_stable_libtorch.abi3.so")
    found = {}
    for name in names:
        m = re.search(rb"\x00(" + re.escape(name.encode()) + rb"\([^\x00]*\) -> [^\x00]*)\x00", blob)
        if m:
            found[name] = m.group(1).decode()
    return found


STUB_C = '''"""Stub of vLLM's ``_C_stable_libtorch`` kernel library (kvelastic bundle, see MANIFEST.json).

platforms/cuda.py imports it at the top to register ``torch.ops._C``. The bundle runs on
Triton attention and torch-native ops, so no kernel of it is called. Some ops are named
(not called) when layers are built and when the compiled path imports its fusion passes;
they are defined here with the real schemas, and calling one raises, naming the op. The
capability queries that modules call at import (is a CUTLASS kernel there for this GPU?)
answer False. Ops that vLLM checks with hasattr before use are not defined.
"""
import torch

SCHEMAS = {schemas!r}


QUERIES = {queries!r}


def _missing(name):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"vLLM kernel _C::{{name}} called, but the kvelastic bundle has no compiled kernels; "
            "run with compilation_config custom_ops=['none'] (see MANIFEST.json engine_args)")
    return call


_lib = torch.library.Library("_C", "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    if not hasattr(torch.ops._C, _name):
        _lib.define(_schema)
        _lib.impl(_name, _missing(_name), "CompositeExplicitAutograd")
for _name, _schema in QUERIES.items():
    if not hasattr(torch.ops._C, _name):
        _lib.define(_schema)
        _lib.impl(_name, lambda *args, **kwargs: False, "CompositeExplicitAutograd")
'''


def vllm_sources(wheel: Path, under: str = "vllm/") -> dict[str, str]:
    """The wheel's ``.py`` files under ``under`` (path -> text)."""
    with zipfile.ZipFile(wheel) as zf:
        return {n: zf.read(n).decode() for n in zf.namelist() if n.startswith(under) and n.endswith(".py")}


def stub_sources(wheel: Path) -> dict[str, tuple[str, str, list[dict]]]:
    """Stub modules: path in the bundle -> (source, why, ops it defines with schema, why and sites).

    Raises if COMPILE_OPS is not exactly what vLLM's compilation sources name unguarded, if a schema is not in
    the .so, or if vLLM asks elsewhere whether a stubbed op exists (CHECKED_STUBS says why each known one is fine).
    """
    plain, guarded = compile_path_handles(vllm_sources(wheel, "vllm/compilation/"))
    if set(plain) != set(COMPILE_OPS):
        raise RuntimeError(f"vllm/compilation names _C ops {sorted(set(plain) - set(COMPILE_OPS))} unguarded that "
                           f"COMPILE_OPS lacks, and COMPILE_OPS lists {sorted(set(COMPILE_OPS) - set(plain))} "
                           "that it does not name")
    placeholders = list(EAGER_OPS) + [n for n in COMPILE_OPS if n not in EAGER_OPS]
    schemas, queries = op_schemas(wheel, placeholders), op_schemas(wheel, QUERY_OPS)
    if missing := sorted(set(placeholders) - set(schemas)) + sorted(set(QUERY_OPS) - set(queries)):
        raise RuntimeError(f"no schema in _C_stable_libtorch.abi3.so for {missing}")
    checks = capability_checks(vllm_sources(wheel), set(schemas) | set(queries))
    if unexplained := sorted(set(checks) - set(CHECKED_STUBS)):
        raise RuntimeError(f"vLLM checks whether stubbed ops exist: {[(n, checks[n]) for n in unexplained]}")
    ops = []
    for name, schema in schemas.items():
        why = "; ".join(w for w in (LAYER_WHY if name in EAGER_OPS else "", COMPILE_OPS.get(name, "")) if w)
        ops.append({"op": f"_C::{name}", "kind": "placeholder (raises if called)", "schema": schema, "why": why,
                    "compile_sites": plain.get(name, []), "capability_checks": checks.get(name, []),
                    **({"checked_ok": CHECKED_STUBS[name]} if name in checks else {})})
    ops += [{"op": f"_C::{name}", "kind": "query (answers False)", "schema": schema, "why": QUERY_WHY}
            for name, schema in queries.items()]
    why = ("platforms/cuda.py:23 imports it unguarded; defines placeholder ops for the activation ops looked up in "
           "layer __init__ and the ops the compiled path's pass modules name at import or compare graph nodes with, "
           "which raise if called, and the capability queries called at import, which answer False (see ops); ops "
           f"vLLM checks with hasattr first stay undefined ({', '.join(sorted(guarded))})")
    return {"vllm/_C_stable_libtorch.py": (STUB_C.format(schemas=schemas, queries=queries), why, ops)}


def left_undefined(wheel: Path) -> dict[str, list[str]]:
    """The ``_C`` ops vllm/compilation names only behind a hasattr/getattr check (op -> sites): not stubbed."""
    return compile_path_handles(vllm_sources(wheel, "vllm/compilation/"))[1]
