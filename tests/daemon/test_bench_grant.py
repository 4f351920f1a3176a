from kvelastic_tools.bench import grant


def test_grant_bench_quick_reports_every_figure():
    out = grant.run(quick=True)
    for label in ("1_engine", "8_engines"):
        for kind in ("grant", "return"):
            assert 0 < out[f"{kind}_p50_us_{label}"] <= out[f"{kind}_p99_us_{label}"] \
                <= out[f"{kind}_p999_us_{label}"]
    assert out["samples_1_engine"] == out["rounds"] and out["samples_8_engines"] == 8 * out["rounds"]
    assert out["raw_map_p50_us"] > 0 and out["grant_over_raw_map_p50"] > 1
