"""The dashboard and the provisioning files, structurally (fast; no Prometheus
needed, except for the PromQL syntax check, which uses ``promtool`` when present)."""

import re
import subprocess
import tempfile

import pytest
import yaml

from tests.observability.dashboard import (
    DASHBOARD,
    DATASOURCES,
    PROVIDERS,
    expand,
    is_defined,
    label_values,
    load_dashboard,
    metric_definitions,
    metric_names_in,
    panels,
    targets,
    variable_query,
    variables,
)
from tests.observability.prometheus_proc import find

RULES = DASHBOARD.parents[2] / "daemon" / "prometheus" / "kvelastic-alerts.yml"

# Panel title -> the metrics it must read.
REQUIRED_PANELS = {
    "Device memory": {"kvelastic_budget_bytes", "kvelastic_memory_bytes"},
    "Memory per engine": {"kvelastic_engine_held_bytes"},
    "Slab grants, returns and reclaims per second": {
        "kvelastic_slab_grants_total", "kvelastic_slab_returns_total", "kvelastic_slab_reclaims_total"},
    "Grant latency": {"kvelastic_grant_latency_seconds_bucket"},
    "Prefix-cache hit rate per engine": {
        "kvelastic_prefix_cache_hits_total", "kvelastic_prefix_cache_queries_total"},
    "Prefix-cache evictions by reason": {"kvelastic_prefix_cache_evictions_total"},
    "Engines connected": {"kvelastic_engines_connected"},
    "Rejected messages": {"kvelastic_rejected_messages_total"},
    "Slab moves and thrash per second": {"kvelastic_slab_moves_total", "kvelastic_slab_thrash_total"},
    "Demand wait": {"kvelastic_demand_wait_seconds_bucket"},
    "Starved engines": {"kvelastic_engine_starved_seconds"},
    "Idle engines": {"kvelastic_engine_idle"},
    "Quarantined memory": {"kvelastic_quarantined_bytes"},
    "Kept cache of departed engines": {"kvelastic_orphaned_cache_bytes"},
    "Blocks adopted and their hits per second": {"kvelastic_adopted_blocks_total", "kvelastic_adopted_hits_total"},
    "Node tier memory": {"kvelastic_tier_bytes", "kvelastic_tier_budget_bytes"},
    "Node tier blocks lost per second": {"kvelastic_tier_failures_total"},
    "Node tier load latency": {"kvelastic_tier_load_seconds_bucket"},
    "Node tier blocks": {"kvelastic_tier_blocks"},
    "Node tier hit rate": {"kvelastic_tier_hit_blocks_total", "kvelastic_tier_lookup_blocks_total"},
    "Node tier demotions and promotions per second": {
        "kvelastic_tier_demotions_total", "kvelastic_tier_promotions_total", "kvelastic_tier_rejected_full_total"},
}
# Per-engine panels: they follow the Engine variable.
ENGINE_PANELS = ("Memory per engine", "Slab grants, returns and reclaims per second",
                 "Prefix-cache hit rate per engine", "Prefix-cache evictions by reason", "Starved engines",
                 "Idle engines", "Blocks adopted and their hits per second")
# Panels that query no data source (Grafana's alert list reads the alerting API).
QUERYLESS = {"alertlist"}
DS = "${DS_PROMETHEUS}"


@pytest.fixture(scope="module")
def dash():
    return load_dashboard()


def test_dashboard_parses_and_has_the_panels(dash):
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] == "kvelastic" and dash["title"]
    by_title = {p["title"]: p for p in panels(dash)}
    assert len(by_title) == len(panels(dash)), "duplicate panel titles"
    missing = set(REQUIRED_PANELS) - set(by_title)
    assert not missing, f"panels missing: {sorted(missing)}"
    for title, metrics in REQUIRED_PANELS.items():
        used = set().union(*(metric_names_in(t.get("expr", "")) for t in by_title[title]["targets"]))
        assert metrics <= used, (title, metrics - used)
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"


def test_panels_do_not_overlap(dash):
    cells = {}
    for p in panels(dash):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_every_target_has_an_expr_on_the_datasource_variable(dash):
    v = variables(dash)
    assert v["DS_PROMETHEUS"]["type"] == "datasource" and v["DS_PROMETHEUS"]["query"] == "prometheus"
    for p in panels(dash):
        if p["type"] in QUERYLESS:
            assert p["targets"] == [] and "datasource" not in p, p["title"]
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": DS}, p["title"]
        assert p["targets"], f"{p['title']} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t.get("expr", "").strip(), f"{p['title']} {t['refId']} has no expr"
            assert t["datasource"] == {"type": "prometheus", "uid": DS}, (p["title"], t["refId"])


def test_every_metric_used_is_defined_in_metrics_py(dash):
    defined = metric_definitions()
    assert len(defined) >= 12
    for name in ("kvelastic_slab_grants_total", "kvelastic_grant_latency_seconds_bucket", "kvelastic_budget_bytes"):
        assert is_defined(name, defined), name
    for name in ("kvelastic_slab_grants", "kvelastic_budget_bytes_total", "kvelastic_slab_device_total"):
        assert not is_defined(name, defined), name
    exprs = [e for _, _, e in targets(dash)] + [variable_query(v) for v in variables(dash).values()
                                                 if v["type"] == "query"]
    for expr in exprs:
        unknown = {n for n in metric_names_in(expr) if not is_defined(n, defined)}
        assert not unknown, f"{expr!r} reads metrics kvelastic/metrics.py does not export: {sorted(unknown)}"


def test_template_variables_are_used(dash):
    v = variables(dash)
    for name, label_of in (("instance", "instance"), ("engine", "engine")):
        var = v[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == DS
        assert label_values(var)[1] == label_of
        assert var["multi"] and var["includeAll"] and var["allValue"] == ".*"
    assert "$instance" in variable_query(v["engine"])   # engines of the selected daemons only
    for title, ref, expr in targets(dash):
        assert 'instance=~"$instance"' in expr, (title, ref)
        if title in ENGINE_PANELS:
            assert 'engine=~"$engine"' in expr, (title, ref)


def test_rates_use_rate_interval(dash):
    for title, ref, expr in targets(dash):
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window == "$__rate_interval", (title, ref, expr)
        if "_total" in expr or "_bucket" in expr:
            if title != "Rejected messages":
                assert "rate(" in expr, (title, ref, expr)


def test_alert_list_shows_the_shipped_alerts(dash):
    """The alert list (on top) shows every alert of daemon/prometheus/kvelastic-alerts.yml,
    firing or pending, and only those: Grafana filters by a case-insensitive substring of the name."""
    (alerts,) = [p for p in panels(dash) if p["type"] == "alertlist"]
    assert alerts["gridPos"]["y"] == 0 and alerts["gridPos"]["w"] == 24
    o = alerts["options"]
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    names = [r["alert"] for r in group["rules"]]
    assert names and all(o["alertName"].lower() in n.lower() for n in names), (o["alertName"], names)
    assert o["alertName"].lower() == "kvelastic"
    assert o["stateFilter"]["firing"] and o["stateFilter"]["pending"] and not o["stateFilter"]["normal"]
    assert not o["dashboardAlerts"] and not o.get("datasource") and not o.get("alertInstanceLabelFilter")
    assert {"type": "panel", "id": "alertlist", "name": "Alert list", "version": ""} in dash["__requires"]


def test_every_panel_type_is_required(dash):
    required = {r["id"] for r in dash["__requires"] if r["type"] == "panel"}
    assert {p["type"] for p in panels(dash)} == required


def test_queries_are_valid_promql():
    """Every expanded expression through ``promtool check rules`` (the PromQL parser)."""
    promtool = find("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    dash = load_dashboard()
    exprs = [e for _, _, e in targets(dash)]
    exprs += [label_values(v)[0] for v in variables(dash).values() if v["type"] == "query" and label_values(v)[0]]
    rules = [{"record": f"kvelastic:check:{i}", "expr": expand(e, {}, "1m")} for i, e in enumerate(exprs)]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump({"groups": [{"name": "kvelastic-dashboard", "rules": rules}]}, f)
        f.flush()
        out = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


def test_provisioning_files_parse():
    ds = yaml.safe_load(DATASOURCES.read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert re.fullmatch(r"\$\{?KVELASTIC_PROMETHEUS_URL\}?", source["url"]), source["url"]
    # the dashboard's data source variable defaults to the provisioned data source
    assert variables(load_dashboard())["DS_PROMETHEUS"]["current"]["value"] == source["uid"]

    prov = yaml.safe_load(PROVIDERS.read_text())
    assert prov["apiVersion"] == 1
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    assert DASHBOARD.parent.name == "dashboards" and DASHBOARD.suffix == ".json"
