"""The dashboard's hit rate is vLLM's: a real `vllm serve` through kvelastic,
a real daemon and a real Prometheus scraping both.

A multi-turn workload (each turn resends the conversation so far) gives
partial prefix hits; the dashboard's "Prefix-cache hit rate per engine"
query over the daemon's series must equal
``vllm:prefix_cache_hits / vllm:prefix_cache_queries`` over the same window,
and the raw counters must agree token for token.
"""

import time

import pytest

pytest.importorskip("vllm")

from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama
from kvelastic_tools.vllm_bench.vllm_serve import counter
from tests.daemon_proc import DaemonProcess, wait_for
from tests.observability.dashboard import expand, load_dashboard, panels
from tests.observability.prometheus_proc import PrometheusProcess, find
from tests.vllm.forked import ForkedServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMETHEUS = find("prometheus")
TURNS = ["the cache block page memory token prefix " * 6, "alpha beta gamma delta one two three " * 6,
         "red green blue cat dog bird fish tree river " * 5]


def panel_expr(title: str) -> str:
    [expr] = [t["expr"] for p in panels(load_dashboard()) if p["title"] == title for t in p["targets"]]
    return expr


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed (make setup installs it)")
def test_dashboard_hit_rate_equals_vllms_own(tmp_path):
    model = build_tiny_llama(tmp_path / "tiny-llama")
    daemon = DaemonProcess(tmp_path, memory="128MiB").start()
    server = prom = None
    try:
        server = ForkedServer(model, tmp_path / "vllm.log", env={
            "KVELASTIC_ENABLE": "1", "KVELASTIC_SOCKET": daemon.socket, "KVELASTIC_ENGINE_ID": "chat",
            "KVELASTIC_METRICS_PORT": "0"}).start()
        daemon_target, vllm_target = f"127.0.0.1:{daemon.metrics_port}", f"127.0.0.1:{server.port}"
        prom = PrometheusProcess(tmp_path, [daemon_target, vllm_target], PROMETHEUS).start()
        ours = 'kvelastic_prefix_cache_queries_total{engine="chat"}'
        wait_for(lambda: prom.query(ours) and prom.query("vllm:prefix_cache_queries_total"), timeout=20,
                 interval=0.2, what="both series scraped at 0")
        start = time.time()

        for opening in TURNS:                     # three conversations of four turns
            history = opening
            for turn in range(4):
                reply = server.complete(history, max_tokens=12)["choices"][0]["text"]
                history += reply + f" and then question {turn} about slabs and pages. "

        queries, hits = server.prefix_cache()
        assert 0 < hits < queries
        # The engine's journal reaches the daemon within ~50 ms: then the figures agree token for token.
        wait_for(lambda: counter(daemon.metrics(), 'kvelastic_prefix_cache_queries_total{device="0",engine="chat"}')
                 == queries, timeout=10, what="the daemon's query count equals vLLM's")
        text = daemon.metrics()
        assert counter(text, 'kvelastic_prefix_cache_hits_total{device="0",engine="chat"}') == hits
        for expr, want in ((ours, queries), ('kvelastic_prefix_cache_hits_total{engine="chat"}', hits),
                           ("sum(vllm:prefix_cache_queries_total)", queries),
                           ("sum(vllm:prefix_cache_hits_total)", hits)):
            wait_for(lambda expr=expr, want=want: prom.value(expr) == want, timeout=10, interval=0.2,
                     what=f"Prometheus: {expr}")

        # The window reaches 3 s before the workload: every series starts with a
        # sample at 0 in it, so rate()'s extrapolation treats hits and queries alike.
        at = time.time()
        window = f"{int(at - start) + 3}s"
        panel = prom.query(expand(panel_expr("Prefix-cache hit rate per engine"),
                                  {"instance": [daemon_target], "engine": ["chat"]}, window), at=at)
        vllm_rate = prom.value(f"sum(rate(vllm:prefix_cache_hits_total[{window}])) / "
                               f"sum(rate(vllm:prefix_cache_queries_total[{window}]))")
        assert [s["metric"]["engine"] for s in panel] == ["chat"]
        assert panel[0]["value"] == pytest.approx(vllm_rate, rel=1e-9) == pytest.approx(hits / queries, rel=1e-9)
        print(f"hit rate: dashboard {panel[0]['value']:.4f}, vLLM {vllm_rate:.4f} ({hits:.0f} of {queries:.0f} tokens)")
    finally:
        for proc in (prom, server):
            if proc is not None:
                proc.stop()
        daemon.stop()
