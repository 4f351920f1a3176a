"""The vmm benchmark runs and reports its fields (speed is judged by the bench, not here)."""

from __future__ import annotations

from kvelastic_tools.bench import vmm


def test_quick_host_bench_reports_every_field() -> None:
    result = vmm.run(quick=True, backend="host")
    assert result["backend"] == "host"
    assert result["page_size"] == 2 << 20
    assert result["iterations"] > 0
    for op in ("map", "unmap"):
        for field in (f"{op}_p50_us", f"{op}_p99_us", f"raw_{op}_p50_us", f"raw_{op}_p99_us", f"{op}_ratio_p50"):
            assert result[field] > 0, field
        assert result[f"{op}_p99_us"] >= result[f"{op}_p50_us"]
