"""The Grafana dashboard as data: its panels, queries and variables, and the
metric names ``kvelastic/metrics.py`` exports. Shared by the structural test and
the test against a real Prometheus."""

from __future__ import annotations

import ast
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvelastic.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "kvelastic.yaml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "kvelastic.yaml"
METRICS_PY = ROOT / "kvelastic" / "metrics.py"

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


# Sample names each kind of metric exposes, by the constructor that defines it.
SUFFIXES = {
    "Counter": ("_total", "_created"), "CounterMetricFamily": ("_total", "_created"),
    "Gauge": ("",), "GaugeMetricFamily": ("",),
    "Histogram": ("_bucket", "_count", "_sum", "_created"),
    "HistogramMetricFamily": ("_bucket", "_count", "_sum", "_created"),
    "Summary": ("", "_count", "_sum", "_created"), "SummaryMetricFamily": ("", "_count", "_sum", "_created"),
    "Info": ("_info",), "InfoMetricFamily": ("_info",),
}


def metric_definitions() -> list[tuple[re.Pattern, str]]:
    """The metrics ``kvelastic/metrics.py`` defines, read from its source (no
    import, no daemon): each constructor call above whose first argument is the
    metric's name, a literal or an f-string, as (regex of the sample names, kind).
    An f-string's ``{PREFIX}`` is the module's constant; any other placeholder
    (``{name}`` in a loop) matches a word literal of the statement around the call."""
    tree = ast.parse(METRICS_PY.read_text())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}
    # the innermost statement around each call: a placeholder's values are its word
    # literals, those in lists (label names) left out
    stmt_of: dict[ast.AST, ast.stmt] = {}
    for stmt in (n for n in ast.walk(tree) if isinstance(n, ast.stmt)):
        for node in ast.walk(stmt):
            stmt_of[node] = stmt          # inner statements are walked later and win
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        kind = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if kind not in SUFFIXES:
            continue
        in_lists = {id(e) for n in ast.walk(stmt_of[node]) if isinstance(n, ast.List) for e in n.elts}
        literals = {n.value for n in ast.walk(stmt_of[node]) if isinstance(n, ast.Constant) and id(n) not in in_lists
                    and isinstance(n.value, str) and re.fullmatch(r"[a-z][a-z0-9_]*", n.value)}
        word = "(?:" + "|".join(sorted(map(re.escape, literals), key=len, reverse=True)) + ")"
        arg, pattern = node.args[0], ""
        parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
        for part in parts:
            if isinstance(part, ast.Constant):
                pattern += re.escape(part.value)
            elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) \
                    and part.value.id in consts:
                pattern += re.escape(consts[part.value.id])
            else:
                pattern += word
        suffixes = "|".join(re.escape(x) for x in SUFFIXES[kind])
        out.append((re.compile(f"{pattern}(?:{suffixes})"), kind))
    return out


def is_defined(name: str, definitions: list[tuple[re.Pattern, str]] | None = None) -> bool:
    """Whether a sample name (``kvelastic_slab_grants_total``) is one metrics.py exports."""
    return any(rx.fullmatch(name) for rx, _ in definitions or metric_definitions())
