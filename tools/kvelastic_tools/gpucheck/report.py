"""The kit's report: what ran where (device, versions, date), one JSON object,
and a short text summary a person reads first.

The device is described through the driver API alone (``cuInit`` and device
queries create no context), so describing it costs no GPU memory and cannot
disturb the memory figures the parts measure.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

TITLES = {
    "1": "CUDA backend tests (-m gpu)",
    "2": "daemon flows with real processes",
    "3": "KV correctness (paged attention)",
    "4": "benchmarks",
    "5": "real vLLM through the daemon",
}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def device_info() -> dict[str, Any]:
    """Name, count, memory, compute capability and driver version of GPU 0, or why there is none."""
    from kvelastic.vmm import cuda_usable

    usable, why = cuda_usable()
    if not usable:
        return {"name": None, "why": why}
    from cuda.bindings import driver as d

    def get(call: str, *args: Any) -> Any:
        result = getattr(d, call)(*args)
        if result[0]:
            raise RuntimeError(f"{call}: {result[0]}")
        return result[1]

    dev = get("cuDeviceGet", 0)
    name = get("cuDeviceGetName", 256, dev)
    attr = d.CUdevice_attribute
    major = get("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    minor = get("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    driver = int(get("cuDriverGetVersion"))
    return {
        "name": (name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)).strip(),
        "count": int(get("cuDeviceGetCount")),
        "total_bytes": int(get("cuDeviceTotalMem", dev)),
        "compute_capability": f"{major}.{minor}",
        "driver_cuda_version": f"{driver // 1000}.{driver % 1000 // 10}",
        "why": why,
    }


def environment(backend: str) -> dict[str, Any]:
    try:
        import torch

        torch_info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    except Exception as exc:  # noqa: BLE001 - reported, the parts will fail on their own
        torch_info = {"torch": f"not importable: {exc}", "torch_cuda": None}
    try:
        device = device_info()
    except Exception as exc:  # noqa: BLE001 - a half-broken driver is itself a finding
        device = {"name": None, "why": f"{type(exc).__name__}: {exc}"}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": backend,
        "device": device,
        "python": platform.python_version(),
        "machine": platform.machine(),
        **torch_info,
        "cuda_bindings": _version("cuda-bindings") or _version("cuda-python"),
        "pyzmq": _version("pyzmq"),
        "msgspec": _version("msgspec"),
        "executable": sys.executable,
    }


def overall(parts: dict[str, dict[str, Any]]) -> str:
    return "failed" if any(p.get("status") == "failed" for p in parts.values()) else "passed"


def _part_line(key: str, part: dict[str, Any]) -> str:
    status = part.get("status", "?")
    counts = part.get("counts") or {}
    if "checks" in part:
        ok = sum(c["ok"] for c in part["checks"])
        detail = f"{ok}/{len(part['checks'])} checks"
        if part.get("pending"):
            detail += f"; pending: {len(part['pending'])}"
    elif "passed" in counts:
        detail = f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, " \
                 f"{counts['skipped']} skipped"
    elif "collected" in counts:
        detail = f"{counts['collected']} GPU tests collected"
    else:
        detail = ""
    return f"part {key} {TITLES[key]:<36} {status:<8} {detail} ({part.get('seconds', 0)} s)"


def _bench_lines(figures: dict[str, Any]) -> list[str]:
    lines = []
    driver = figures.get("driver") or {}
    if "per_page" in driver:
        per, anchors = driver["per_page"], driver["anchors_us"]
        lines.append("  per 2 MiB page, p50 us (kvcached A100 anchor): " + ", ".join(
            f"{k} {per[k]['p50_us']} ({v})" for k, v in anchors.items()))
        batched = driver.get("batched") or {}
        if "map_plus_one_access_per_page_us" in batched:
            lines.append(f"  map+access batched over {batched['pages']} pages: "
                         f"{batched['map_plus_one_access_per_page_us']} us/page "
                         f"(one by one {batched['map_plus_access_one_by_one_p50_us']})")
    zero = figures.get("zeroing") or {}
    if "backend_zero_gbps" in zero:
        lines.append(f"  zeroing: backend {zero['backend_zero_gbps']} GB/s, torch.zero_ {zero['torch_zero_gbps']} "
                     f"GB/s, zeroed={zero['zeroed']}")
    grant = figures.get("grant") or {}
    for label, values in grant.items():
        if isinstance(values, dict) and "grant_p50_us" in values:
            lines.append(f"  grant end to end ({label}): p50 {values['grant_p50_us']} us, "
                         f"p99 {values['grant_p99_us']} us")
    recycle = figures.get("recycling") or {}
    if "fresh_p50_us" in recycle:
        lines.append(f"  recycling per page, p50: fresh {recycle['fresh_p50_us']} us, zero in place "
                     f"{recycle['in_place_p50_us']} us; chosen {recycle['chosen']} (a kept descriptor shows: "
                     f"fresh {recycle['isolation_fresh']}, in place {recycle['isolation_in_place']})")
    handoff = figures.get("handoff") or {}
    if "handoff_p50_us" in handoff:
        lines.append(f"  handoff (reclaim + grant): p50 {handoff['handoff_p50_us']} us, "
                     f"p99 {handoff['handoff_p99_us']} us")
    tier = figures.get("tier") or {}
    if "demote_gbps" in tier:
        memory = "pinned" if tier["pinned"] else "host"
        lines.append(f"  tier, per {tier['page_bytes'] >> 20} MiB page to/from {memory} "
                     f"memory: demote {tier['demote_gbps']} GB/s ({tier['demote_over_plain']}x a plain copy), "
                     f"promote {tier['promote_gbps']} GB/s ({tier['promote_over_plain']}x), whole={tier['whole']}")
    devices = figures.get("devices") or {}
    if devices:
        lines.append(f"  two devices: {devices.get('status', 'passed')}"
                     + (f" ({devices['why']})" if "why" in devices else ""))
    errors = [f"{k}: {v['error']}" for k, v in figures.items() if isinstance(v, dict) and "error" in v]
    lines += [f"  ERROR {e}" for e in errors]
    return lines


def _vllm_lines(figures: dict[str, Any]) -> list[str]:
    """Part 5's figures: engine start and the cold batch, stock against through the daemon."""
    def run_line(name: str, run: dict[str, Any]) -> str:
        if not run.get("ok"):
            return f"  {name}: {run.get('error', 'failed')}"
        return f"  {name}: start {run.get('start_s')} s, cold batch {run['cold']['seconds']} s, " \
               f"hits cold/warm/reset {run['cold']['hits']}/{run['warm']['hits']}/{run['reset']['hits']}"
    lines = []
    if figures.get("stock"):
        lines.append(run_line("stock", figures["stock"]))
    for key in sorted(k for k, v in figures.items() if k.startswith("elastic_") and isinstance(v, dict)):
        lines.append(run_line(f"engine {key[len('elastic_'):]} through kvelastic", figures[key]))
    compiled = figures.get("compiled") or {}
    if "skipped" in compiled:
        lines.append(f"  compiled: skipped ({compiled['skipped']})")
    elif compiled:
        lines.append(f"  compiled (CUDA graphs captured: {compiled['graphs_captured']}):")
        lines += [run_line(f"  {n}", compiled[n]) for n in ("stock", "elastic") if compiled.get(n)]
    return lines


def summary(report: dict[str, Any]) -> str:
    env = report["environment"]
    device = env["device"]
    where = f"{device['name']} (sm {device.get('compute_capability')}, driver CUDA " \
            f"{device.get('driver_cuda_version')})" if device.get("name") else f"no GPU ({device.get('why')})"
    lines = [f"kvelastic gpu-check {env['date']} backend={env['backend']} device={where}",
             f"torch {env['torch']} (CUDA {env['torch_cuda']}), Python {env['python']}, "
             f"cuda-bindings {env['cuda_bindings']}"]
    for key, part in report["parts"].items():
        lines.append(_part_line(key, part))
        for failure in part.get("failures", [])[:3]:
            first = failure["text"].strip().splitlines()[:1]
            lines.append(f"  FAIL {failure['test']}: {first[0][:160] if first else ''}")
        for check in part.get("checks", []):
            if not check["ok"]:
                lines.append(f"  FAIL {check['name']}: {str(check['detail'])[:160]}")
        for pending in part.get("pending", []):
            lines.append(f"  PENDING {pending['name']}")
        for note in part.get("notes", []):
            lines.append(f"  note: {note}")
        if key == "4":
            lines += _bench_lines(part.get("figures") or {})
        if key == "5":
            lines += _vllm_lines(part.get("figures") or {})
    lines.append(f"overall: {report['status']} ({report['seconds']} s)")
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, text_path = out / "gpu-report.json", out / "summary.txt"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    text_path.write_text(summary(report))
    return json_path, text_path
