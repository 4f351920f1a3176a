"""``python -m kvelastic_tools.gpucheck.probe`` -- what the GPU image holds.

The kit carries vLLM to a machine that reaches no registry, so the bundle
must target what the image has rather than what we guess: every installed
distribution and its version, torch and its CUDA, triton, the CUDA runtime
libraries, the compiler, free disk and memory. Prints one JSON object (and
writes it to ``$OUT/probe.json`` when ``$OUT`` is set). Reads only: it
installs and changes nothing, and never fails on a missing tool.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def command(argv: list[str]) -> str:
    """First 4,000 characters of a tool's output, or why it could not run."""
    if shutil.which(argv[0]) is None:
        return f"(no {argv[0]})"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({argv[0]}: {exc})"
    return (done.stdout + done.stderr)[:4000]


def distributions() -> dict[str, str]:
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name.lower()] = dist.version
    return dict(sorted(found.items()))


def torch_facts() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a probe reports, it does not fail
        return {"error": repr(exc)}
    facts: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                             "cuda_available": torch.cuda.is_available(),
                             "cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None))}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(device=props.name, capability=f"{props.major}.{props.minor}",
                     memory_gib=round(props.total_memory / 2**30, 1), devices=torch.cuda.device_count())
    return facts


def triton_facts() -> dict[str, Any]:
    try:
        import triton  # type: ignore[import-not-found]  # the GPU image's, not the .venv's
    except Exception as exc:  # noqa: BLE001
        return {"error": repr(exc)}
    return {"version": triton.__version__, "path": str(Path(triton.__file__).parent)}


def cuda_libraries() -> list[str]:
    """The shared libraries of the nvidia-* wheels, where torch finds its CUDA."""
    names: set[str] = set()
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        if base.is_dir():
            names.update(p.name for p in base.glob("*/lib/*.so*"))
    return sorted(names)


def disk(path: str) -> dict[str, float]:
    usage = shutil.disk_usage(path)
    return {"free_gib": round(usage.free / 2**30, 1), "total_gib": round(usage.total / 2**30, 1)}


def probe() -> dict[str, Any]:
    meminfo = Path("/proc/meminfo").read_text().splitlines()[:3] if Path("/proc/meminfo").exists() else []
    return {
        "python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
        "cpus": os.cpu_count(), "meminfo": meminfo,
        "torch": torch_facts(), "triton": triton_facts(),
        "nvcc": command(["nvcc", "--version"]).strip().splitlines()[-1:],
        "nvidia_smi": command(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"]).strip(),
        "cuda_libraries": cuda_libraries(),
        "disk": {"cwd": disk(os.getcwd()), "tmp": disk("/tmp")},
        "distributions": distributions(),
    }


def main() -> int:
    result = probe()
    text = json.dumps(result, indent=1)
    out = os.environ.get("OUT")
    if out:
        Path(out, "probe.json").write_text(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "distributions"}, indent=1))
    print(f"probe: {len(result['distributions'])} distributions", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
