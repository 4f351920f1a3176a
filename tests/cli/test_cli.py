import json
import subprocess
import sys

from kvelastic import __version__


def kvelastic(*args):
    return subprocess.run([sys.executable, "-m", "kvelastic", *args], capture_output=True, text=True)


def test_version_and_help():
    assert kvelastic("--version").stdout.strip() == f"kvelastic {__version__}"
    out = kvelastic("--help").stdout
    for command in ("daemon", "bench", "config"):
        assert command in out


def test_unknown_benchmark_is_a_clear_error():
    result = kvelastic("bench", "nope", "--json")
    assert result.returncode == 2 and "unknown benchmark" in result.stderr


def test_a_runtime_without_the_tools_says_where_benchmarks_come_from(monkeypatch, capsys):
    # A node that installed the runtime alone: no package declares a benchmark.
    from kvelastic import benchmarks, cli

    monkeypatch.setattr(benchmarks, "entry_points", lambda group: [])
    assert benchmarks.available() == {}
    assert cli.main(["bench", "core", "--json"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'core'" in err and "none is installed" in err and "make setup" in err


def test_bench_core_prints_json_on_last_line():
    result = kvelastic("bench", "core", "--json", "--quick")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["ops_per_s"] > 0 and data["baseline_ops_per_s"] > 0
    assert 0 < data["hit_rate"] < 1
    assert data["hit_rate"] == data["baseline_hit_rate"]   # same trace, same LRU semantics
    assert data["evictions"]["lru"] > 0


def test_config_error_is_reported_clearly():
    result = subprocess.run([sys.executable, "-m", "kvelastic", "config"], capture_output=True,
                            text=True, env={"KVELASTIC_MEMORY": "lots", "PATH": ""})
    assert result.returncode == 2 and "KVELASTIC_MEMORY" in result.stderr
