"""The Grafana dashboard as data: its panels, queries and variables, and the
metric names ``kvelastic/metrics.py`` exports. Shared by the structural test and
the test against a real Prometheus."""

from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvelastic.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "kvelastic.yaml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "kvelastic.yaml"

# What a Grafana variable of each kind expands to for a query (a Prometheus regex).
VARIABLES = ("instance", "engine")


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return [p for p in out if p.get("type") != "row"]


def targets(dash: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) for every query of every panel."""
    return [(p["title"], t["refId"], t.get("expr", "")) for p in panels(dash) for t in p.get("targets", [])]


def variables(dash: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dash["templating"]["list"]}


def variable_query(var: dict) -> str:
    q = var["query"]
    return q["query"] if isinstance(q, dict) else q


def label_values(var: dict) -> tuple[str | None, str]:
    """``label_values(selector, label)`` or ``label_values(label)`` -> (selector, label)."""
    m = re.fullmatch(r"\s*label_values\(\s*(?:(.+?)\s*,\s*)?([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*", variable_query(var))
    assert m, f"variable {var['name']}: not a label_values() query: {variable_query(var)!r}"
    return m.group(1), m.group(2)


def grafana_regex_escape(value: str) -> str:
    """What Grafana's Prometheus data source puts in a query for one value of a
    multi-value variable (``prometheusSpecialRegexEscape``): regex metacharacters
    escaped with a backslash that is itself escaped for the PromQL string."""
    return re.sub(r"([\\$^*{}\[\]'+?.()|])", r"\\\\\1", value)


def expand(expr: str, values: dict[str, list[str] | None], rate_interval: str) -> str:
    """Substitute the template variables as Grafana does: ``None`` means All
    (the variable's ``allValue``, ``.*``), a list of values becomes ``(a|b)``."""
    for name in VARIABLES:
        vals = values.get(name)
        if vals is None:
            sub = ".*"
        elif len(vals) == 1:
            sub = grafana_regex_escape(vals[0])
        else:
            sub = "(" + "|".join(grafana_regex_escape(v) for v in vals) + ")"
        expr = expr.replace("${" + name + "}", sub)
        expr = re.sub(r"\$" + name + r"\b", lambda _m, s=sub: s, expr)
    expr = expr.replace("${__rate_interval}", rate_interval).replace("$__rate_interval", rate_interval)
    assert "$" not in expr, f"unexpanded variable in {expr!r}"
    return expr


def metric_names_in(expr: str) -> set[str]:
    """Metric names an expression reads: every ``kvelastic_*`` token and every
    name in front of a selector's ``{``."""
    names = set(re.findall(r"\bkvelastic_[a-zA-Z0-9_:]*", expr))
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", expr):
        if m.group(1) not in ("by", "without", "on", "ignoring", "group_left", "group_right"):
            names.add(m.group(1))
    return names


def metric_definitions() -> list[tuple[re.Pattern, str]]:
    """The metrics ``kvelastic/metrics.py`` exports, read from its own
    registry over the books of a real allocator with one engine registered
    and a tier (so every per-engine and tier family has samples): (the family's sample names as
    one pattern, its type). No daemon, and no reading of source code."""
    import os

    from kvelastic import protocol as p
    from kvelastic.daemon.allocator import Allocator
    from kvelastic.metrics import DaemonMetrics
    from kvelastic.tier.index import TierIndex

    page = 2 << 20
    allocator = Allocator({"0": 4}, page, tier=TierIndex(1 << 20))     # a tier: its families too
    allocator.handle(b"engine", p.RegisterEngine(
        version=p.PROTOCOL_VERSION, engine_id="e", pid=os.getpid(), namespace="ns", page_size=page,
        pages_per_worker=1, num_workers=1, blocks_per_slab=4, block_bytes=page // 4), now=0.0)
    registry = DaemonMetrics(allocator.status, ["0"]).registry
    out = []
    for family in registry.collect():
        names = {sample.name for sample in family.samples}
        if family.type == "counter":      # declared by its base name: samples may not exist yet
            names |= {f"{family.name}_total", f"{family.name}_created"}
        elif family.type == "histogram":
            names |= {f"{family.name}{x}" for x in ("_bucket", "_count", "_sum", "_created")}
        else:
            names.add(family.name)
        out.append((re.compile("|".join(sorted(map(re.escape, names)))), family.type))
    return out


def is_defined(name: str, definitions: list[tuple[re.Pattern, str]] | None = None) -> bool:
    """Whether a sample name (``kvelastic_slab_grants_total``) is one metrics.py exports."""
    return any(rx.fullmatch(name) for rx, _ in definitions or metric_definitions())
