"""The Prometheus alerting rules shipped in ``daemon/prometheus/``.

- ``promtool check rules`` accepts the rule file and ``promtool test rules``
  passes its unit tests (``kvelastic-alerts.test.yml``), where every alert both
  fires and, below its threshold or before its ``for:`` has elapsed, does not;
- every metric a rule reads is one a real daemon exports on ``/metrics``;
- a real Prometheus loads the rules against a real daemon: every rule healthy,
  no alert for the healthy daemon, KvelasticDaemonDown pending for a target
  that does not answer, and each rule's signal carries the labels its
  annotations name;
- the Alerts table (docs/observability.md) and grafana/README.md keep up with the file;
- KvelasticDaemonDown also fires for a daemon that answers scrapes with a
  stale snapshot (its loop stuck), and a real daemon's snapshot is fresh.
"""

from __future__ import annotations

import copy
import math
import re
import subprocess
import time

import pytest
import yaml

from tests.daemon.books import parse_metrics, value
from tests.daemon.engines import EngineProcess
from tests.daemon_proc import DaemonProcess, free_port, wait_for
from tests.observability.dashboard import ROOT, is_defined, metric_definitions, metric_names_in
from tests.observability.prometheus_proc import PrometheusProcess, find

RULES_DIR = ROOT / "daemon" / "prometheus"
RULES = RULES_DIR / "kvelastic-alerts.yml"
RULES_TEST = RULES_DIR / "kvelastic-alerts.test.yml"
JOB = "kvelastic"          # the scrape job the rules name, as in grafana/README.md and prometheus_proc.py
SEVERITIES = {"critical", "warning"}
IDENTIFYING = {"instance", "device", "engine", "reason"}   # labels that say *what* is wrong
PROMETHEUS, PROMTOOL = find("prometheus"), find("promtool")
NO_PROMTOOL = "promtool is not installed (Debian package `prometheus`; `make setup` installs it)"


def rules() -> list[dict]:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    assert group["name"] == "kvelastic"
    return group["rules"]


def promtool(*args: str) -> str:
    if PROMTOOL is None:
        pytest.skip(NO_PROMTOOL)
    out = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=RULES_DIR)
    report = out.stdout + out.stderr
    assert out.returncode == 0, f"promtool {' '.join(args)} (exit {out.returncode}):\n{report}"
    return report


def signal_of(expr: str) -> str | None:
    """The part of ``expr`` that is compared to a threshold (None for ``absent()``)."""
    m = re.fullmatch(r"\s*(.*?)\s*(?:>|==)\s*[0-9.]+\s*", expr, re.S)
    return m.group(1) if m else None


def labels_named(rule: dict) -> set[str]:
    text = " ".join(rule["annotations"].values())
    return set(re.findall(r"\$labels\.(\w+)", text))


# ------------------------------------------------------------------- promtool
def test_promtool_check_rules():
    report = promtool("check", "rules", RULES.name)
    assert f"SUCCESS: {len(rules())} rules found" in report, report


def test_promtool_unit_tests_pass():
    report = promtool("test", "rules", RULES_TEST.name)
    assert "SUCCESS" in report, report


STALE_AGE = "kvelastic_snapshot_age_seconds"


def test_daemon_down_fires_for_a_stuck_loop_whose_metrics_still_answer(tmp_path):
    """The unit tests have a case where every scrape succeeds (``up`` 1) but
    the daemon's snapshot grows old, and KvelasticDaemonDown fires there: with
    the rule file it passes, and with the rule's stale-snapshot half removed it
    fails (the case proves that half)."""
    spec = yaml.safe_load(RULES_TEST.read_text())
    cases = [t for t in spec["tests"]
             if any(s["series"].startswith(STALE_AGE + "{") for s in t["input_series"])
             and all(re.fullmatch(r"1\+0x\d+", s["values"].strip())
                     for s in t["input_series"] if s["series"].startswith("up{"))
             and any(c["alertname"] == "KvelasticDaemonDown" and c.get("exp_alerts")
                     for c in t["alert_rule_test"])]
    assert len(cases) == 1, "no unit test of KvelasticDaemonDown for a stale snapshot while scrapes succeed"
    (down,) = [r for r in rules() if r["alert"] == "KvelasticDaemonDown"]
    assert re.search(STALE_AGE + r"\s*>\s*30\b", down["expr"]), down["expr"]

    def run(rule_file) -> subprocess.CompletedProcess:
        test = dict(spec, rule_files=[str(rule_file)], tests=cases)
        path = tmp_path / f"{rule_file.stem}.test.yml"
        path.write_text(yaml.safe_dump(test, sort_keys=False))
        if PROMTOOL is None:
            pytest.skip(NO_PROMTOOL)
        return subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)

    out = run(RULES)
    assert out.returncode == 0, out.stdout + out.stderr
    without = copy.deepcopy(yaml.safe_load(RULES.read_text()))
    for r in without["groups"][0]["rules"]:
        if r.get("alert") == "KvelasticDaemonDown":
            r["expr"] = f'up{{job="{JOB}"}} == 0'
    mutant = tmp_path / "up-only.yml"
    mutant.write_text(yaml.safe_dump(without, sort_keys=False))
    out = run(mutant)
    assert out.returncode != 0 and "KvelasticDaemonDown" in out.stdout + out.stderr, \
        "the stale-snapshot case passes without the rule's stale-snapshot half"


# ----------------------------------------------------------------- structure
def test_every_rule_is_an_alert_an_operator_can_act_on():
    names = [r.get("alert") for r in rules()]
    assert len(names) == len(set(names)) >= 6 and all(n and n.startswith("Kvelastic") for n in names), names
    for r in rules():
        assert "record" not in r, r
        assert re.fullmatch(r"\d+[smh]", r.get("for", "")), f"{r['alert']}: no `for:`"
        assert r["labels"]["severity"] in SEVERITIES, r["alert"]
        assert set(r["annotations"]) >= {"summary", "description"}, r["alert"]
        assert len(r["annotations"]["description"]) > 150, f"{r['alert']}: say what to do"
        if 'up{job="' in r["expr"]:
            assert f'up{{job="{JOB}"}}' in r["expr"], r["expr"]
    wanted = {"KvelasticEngineStarved", "KvelasticThrash", "KvelasticPagesQuarantined", "KvelasticDaemonDown",
              "KvelasticRejectedSpike"}
    assert wanted <= set(names), wanted - set(names)


def test_every_alert_has_firing_and_silent_unit_tests():
    """Each alert is proven both ways: some case expects it to fire, some case
    (an evaluation before ``for:`` has elapsed, or a series under the threshold
    next to one that fires) expects it silent."""
    spec = yaml.safe_load(RULES_TEST.read_text())
    assert spec["rule_files"] == [RULES.name]
    fires, silent = set(), set()
    for test in spec["tests"]:
        for case in test["alert_rule_test"]:
            (fires if case.get("exp_alerts") else silent).add(case["alertname"])
            for alert in case.get("exp_alerts") or []:
                # the rendered text, compared by promtool
                assert alert["exp_annotations"]["summary"] and alert["exp_annotations"]["description"], case
    names = {r["alert"] for r in rules()}
    assert fires == names, f"alerts never seen firing: {sorted(names - fires)}"
    assert silent == names, f"alerts never seen staying silent: {sorted(names - silent)}"


def test_every_rule_reads_metrics_that_metrics_py_defines():
    defined = metric_definitions()
    for r in rules():
        used = metric_names_in(r["expr"]) - {"up"}
        unknown = {n for n in used if not is_defined(n, defined)}
        assert not unknown, f"{r['alert']} reads {sorted(unknown)}, which kvelastic/metrics.py does not define"


def test_docs_and_grafana_readme_document_the_alerts():
    page = ROOT / "docs" / "observability.md"
    m = re.search(r"^### Alerts\n(.*?)(?=^##? |\Z)", page.read_text(), re.S | re.M)
    assert m, "docs/observability.md has no '### Alerts' section"
    section = m.group(1)
    assert "daemon/prometheus/kvelastic-alerts.yml" in section
    assert "://" not in section, "the docs link only inside the repository"
    for link in re.findall(r"\]\(([^)#]*)(?:#[^)]*)?\)", section):
        assert not link or (page.parent / link).exists(), f"{page.name} links to {link!r}, not in the repository"
    for r in rules():
        row = next((line for line in section.splitlines() if f"`{r['alert']}`" in line), None)
        assert row, f"docs/observability.md's Alerts table lacks {r['alert']}"
        assert r["for"] in row and r["labels"]["severity"] in row, (r["alert"], row)
    grafana = (ROOT / "grafana" / "README.md").read_text()
    assert "rule_files" in grafana and "kvelastic-alerts.yml" in grafana


# ------------------------------------------------------------- a real daemon
@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A daemon with one registered engine, so its per-engine series exist."""
    tmp = tmp_path_factory.mktemp("alerts")
    # With the node's tier on, so that its series are exported too.
    daemon = DaemonProcess(tmp, memory="16MiB", KVELASTIC_TIER_DIR=str(tmp / "tier")).start()
    engine = None
    try:
        engine = EngineProcess(daemon.socket, "a", grace=1.0, namespace="llama")
        assert engine.do("ensure", n=4)["ok"]               # one demand grow: a demand-wait sample
        # /metrics reads the loop's latest published snapshot
        wait_for(lambda: 'kvelastic_engine_starved_seconds{device="0",engine="a"}' in daemon.metrics(),
                 interval=0.1, what="engine a's series on /metrics")
        yield dict(daemon=daemon, tmp=tmp)
    except BaseException:
        print("--- daemon log ---\n" + daemon.log())
        raise
    finally:
        if engine is not None:
            engine.close()
        daemon.stop()


def test_every_metric_a_rule_reads_is_exported_by_the_daemon(node):
    exported = {name for name, _ in parse_metrics(node["daemon"].metrics())}
    read = set()
    for r in rules():
        used = metric_names_in(r["expr"]) - {"up"}        # `up` is Prometheus's own
        missing = used - exported
        assert not missing, f"{r['alert']} reads {sorted(missing)}; /metrics has no such series"
        read |= used
    assert {"kvelastic_engine_starved_seconds", "kvelastic_slab_thrash_total", "kvelastic_quarantined_bytes",
            "kvelastic_rejected_messages_total", "kvelastic_demand_wait_seconds_bucket", STALE_AGE} <= read, read


def test_a_running_daemon_exports_a_fresh_snapshot_age(node):
    """The loop publishes its snapshot every 0.1 s: over 2 s of scrapes, the
    age /metrics reports stays well under a second (a snapshot never published
    again would be 2 s old by the end)."""
    daemon = node["daemon"]
    started, ages = time.monotonic(), []

    def scraped_for_2s() -> bool:
        ages.append(value(parse_metrics(daemon.metrics()), STALE_AGE))
        return time.monotonic() - started >= 2.0

    wait_for(scraped_for_2s, timeout=10, interval=0.1, what="2 s of scrapes")
    assert len(ages) >= 5 and all(0.0 <= age < 1.0 for age in ages), ages


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus server is not installed "
                    "(/usr/bin/prometheus, Debian package `prometheus`; `make setup` installs it)")
def test_prometheus_loads_the_rules_against_a_real_daemon(node):
    daemon = node["daemon"]
    target = f"127.0.0.1:{daemon.metrics_port}"
    dead = f"127.0.0.1:{free_port()}"                        # nothing listens there: up == 0
    prom = PrometheusProcess(node["tmp"], [target, dead], PROMETHEUS, rule_files=[RULES]).start()
    try:
        by_name = {r["alert"]: r for r in rules()}

        def loaded():
            groups = prom.api("rules")["groups"]
            got = {r["name"]: r for g in groups if g["name"] == "kvelastic" for r in g["rules"]}
            evaluated = all(not r["lastEvaluation"].startswith("0001") and r["health"] != "unknown"
                            for r in got.values())
            return got if set(got) == set(by_name) and evaluated else None

        got = wait_for(loaded, timeout=15, interval=0.2, what="Prometheus to load and evaluate the rules")
        for name, r in got.items():
            assert r["type"] == "alerting" and r["health"] == "ok", (name, r.get("lastError"), r["health"])

        # two scrapes of each target, so increase() and rate() have samples to work on
        wait_for(lambda: len(prom.query(f'count_over_time(up{{job="{JOB}"}}[1m]) >= 3')) == 2,
                 timeout=10, interval=0.2, what="three scrapes of each target")

        def down_pending():
            alerts = prom.api("alerts")["alerts"]
            return alerts if any(a["labels"]["alertname"] == "KvelasticDaemonDown" for a in alerts) else None

        alerts = wait_for(down_pending, timeout=10, interval=0.2, what="KvelasticDaemonDown for the dead target")
        active = {(a["labels"]["alertname"], a["labels"].get("instance"), a["state"]) for a in alerts}
        # the healthy daemon raises nothing; the dead target is down for less than `for:`
        assert active == {("KvelasticDaemonDown", dead, "pending")}, active

        # Each rule's signal, evaluated on the real series, carries what its annotations name.
        for name, r in by_name.items():
            signal = signal_of(r["expr"])
            if signal is None:
                assert prom.query(r["expr"]) == [], name           # absent(): the job has targets
                continue
            samples = [s for s in prom.query(signal) if s["metric"].get("instance") == target]
            assert samples, f"{name}: {signal} has no series for the daemon"
            for s in samples:
                have = set(s["metric"])
                assert labels_named(r) <= have, f"{name}: annotations name {labels_named(r) - have}, not in {have}"
                assert have & IDENTIFYING <= labels_named(r), \
                    f"{name}: annotations never name {(have & IDENTIFYING) - labels_named(r)}"
                if "histogram_quantile" not in signal:               # no demand grow in the window: NaN
                    assert math.isfinite(s["value"]), (name, s)
    except BaseException:
        print("--- prometheus log ---\n" + prom.log())
        raise
    finally:
        prom.stop()
