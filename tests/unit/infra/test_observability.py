"""The Grafana dashboard and the Prometheus alert rules query only metrics that exist.

Every metric name a PromQL expression uses (dashboard targets, variable queries, rule
exprs) must be a series shoal exports, read from prometheus_client's registry after
importing the modules that define shoal's metrics (in a fresh interpreter, so that
nothing else this test session registered counts), or one of RabbitMQ's own metrics
listed in RABBITMQ_METRICS. Names are matched as series: a counter `x` is exported as
`x_total`, a histogram `x` as `x_bucket`, `x_count` and `x_sum`, a gauge as `x`; a query
of a histogram's bare name, or of `x_total` for a gauge, is an error.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.stack import REPO

DASHBOARD = Path(REPO) / "infra" / "grafana" / "dashboards" / "shoal.json"
RULES = Path(REPO) / "infra" / "prometheus" / "alerts.yaml"

# The modules that define shoal's Prometheus metrics (grep for Counter(, Gauge(,
# Histogram(, Summary( under app/ gateway/ runtimes/ batching/ tasks/). The broker-link
# metrics are made by calling worker_link() and gateway_link().
METRIC_MODULES = ("app.worker.metrics", "tasks.broker_metrics", "gateway.edge.gateway_metrics",
                  "gateway.auth.access", "gateway.auth.rate_limit")

# RabbitMQ's rabbitmq_prometheus plugin (port 15692), scraped at
# /metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count; names from
# deps/rabbitmq_prometheus/metrics-detailed.md of rabbitmq-server (3.10 on). Each
# carries `vhost` and `queue` labels. Add a name here only from that list.
RABBITMQ_METRICS = frozenset({
    "rabbitmq_detailed_queue_messages_ready",    # queue_coarse_metrics
    "rabbitmq_detailed_queue_messages_unacked",  # queue_coarse_metrics
    "rabbitmq_detailed_queue_messages",          # queue_coarse_metrics: ready + unacked
    "rabbitmq_detailed_queue_consumers",         # queue_consumer_count
})

_PROBE = """
import json, sys
from prometheus_client import REGISTRY
for name in {modules!r}:
    __import__(name)
from tasks.broker_metrics import gateway_link, worker_link
worker_link(); gateway_link()
families = [[f.name, f.type] for f in REGISTRY.collect()]
heavy = sorted(m for m in ("torch", "transformers", "celery.worker") if m in sys.modules)
print(json.dumps({{"families": families, "heavy": heavy}}))
"""

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
             "summary": ("_count", "_sum", ""), "gauge": ("",), "info": ("_info",),
             "unknown": ("",)}


@cache
def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(modules=METRIC_MODULES)],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


@cache
def exported_series() -> frozenset[str]:
    """The series names shoal's processes export (prometheus_client's own process_* and
    python_* collectors excluded: only shoal_ names)."""
    names = set()
    for family, kind in _probe()["families"]:
        if family.startswith("shoal_"):
            names.update(family + suffix for suffix in _SUFFIXES[kind])
    return frozenset(names)


# --- a small PromQL metric-name extractor --------------------------------------------

def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


FUNCTIONS = _words("""
abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
days_in_month deg delta deriv exp floor histogram_avg histogram_count histogram_fraction
histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta
increase irate label_join label_replace last_over_time ln log10 log2 mad_over_time
max_over_time min_over_time minute month pi predict_linear present_over_time
quantile_over_time rad rate resets round scalar sgn sin sinh sort sort_by_label
sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh
time timestamp vector year double_exponential_smoothing
""")
AGGREGATIONS = _words("""
sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk
limit_ratio
""")
KEYWORDS = _words("""
by without on ignoring group_left group_right offset bool and or unless atan2 inf nan
start end
""")
# Grafana's own variable-query functions (templating only).
GRAFANA_FUNCTIONS = frozenset({"label_values", "label_names", "metrics", "query_result"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'" r"|`[^`]*`")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?"
                     r"(?:ms|[smhdwy])?(?:\d+(?:ms|[smhdwy]))*)(?![\w:])")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str, *, grafana: bool = False) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings,
    Grafana variables, label matchers, ranges, grouping labels and numbers are taken
    out, less functions and keywords. A call of anything but a known function is an
    error (a misspelt function would otherwise pass as a metric)."""
    text = _STRING.sub(" ", expr)
    text = _VARIABLE.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    if grafana:  # label_values(metric, label): the label is not a metric
        text = re.sub(r"\blabel_values\s*\((.*),\s*[A-Za-z_]\w*\s*\)\s*$", r"(\1)", text,
                      flags=re.S)
    names = set()
    for match in _IDENT.finditer(text):
        name = match.group()
        called = text[match.end():].lstrip().startswith("(")
        known = FUNCTIONS | AGGREGATIONS | (GRAFANA_FUNCTIONS if grafana else frozenset())
        if name in known or name in KEYWORDS:
            continue
        if called:
            raise ValueError(f"{name}(...) is not a PromQL function, in: {expr}")
        names.add(name)
    return names


# --- the files -------------------------------------------------------------------------

@cache
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@cache
def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))  # panels inside collapsed rows
    return out


def dashboard_exprs() -> list[tuple[str, str, bool]]:
    """(where, expr, is a Grafana variable query) for every query of the dashboard."""
    exprs = []
    for panel in _panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            exprs.append((f"panel {panel['id']} {panel.get('title')!r} {target.get('refId')}",
                          target["expr"], False))
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            query = query["query"] if isinstance(query, dict) else query
            exprs.append((f"variable {var['name']}", query, True))
            exprs.append((f"variable {var['name']} definition", var["definition"], True))
    return exprs


def rule_exprs() -> list[tuple[str, str]]:
    return [(f"{group['name']}/{rule.get('alert') or rule.get('record')}", rule["expr"])
            for group in rules()["groups"] for rule in group["rules"]]


# --- the extractor itself ----------------------------------------------------------------

@pytest.mark.parametrize(("expr", "names"), [
    ('histogram_quantile(0.99, sum by (le, model) (rate(shoal_queue_wait_seconds_bucket'
     '{model=~"$model"}[$__rate_interval])))', {"shoal_queue_wait_seconds_bucket"}),
    ("sum without (instance) (rate(a_total[5m] offset 1h)) / on (model) group_left (x) "
     "b > bool 0.5", {"a_total", "b"}),
    ('max by (queue) (q{queue=~".+\\\\.model\\\\..+"}) > 0 and on (queue) c == 0',
     {"q", "c"}),
    ("delta(shoal_runtime_restarts[15m]) > 0", {"shoal_runtime_restarts"}),
    ('label_replace(up{job="x"}, "dst", "$1", "src", "(.*)")', {"up"}),
    ("rate(x[1h30m:1m]) * 1e3 + topk(5, y)", {"x", "y"}),
    ("count(z) by (model)", {"z"}),
])
def test_the_extractor_finds_exactly_the_metrics(expr, names):
    assert metric_names(expr) == names


def test_the_extractor_reads_grafana_variable_queries():
    assert metric_names('label_values(m{queue=~".+"}, queue)', grafana=True) == {"m"}
    assert metric_names("label_values(shoal_results_total, model)", grafana=True) == {
        "shoal_results_total"}


def test_the_extractor_refuses_an_unknown_function():
    with pytest.raises(ValueError, match="rat"):
        metric_names("rat(shoal_returned_total[5m])")


def test_a_wrong_name_would_be_caught():
    exported = exported_series()
    assert "shoal_returned_total" in exported  # a counter, as Prometheus names it
    assert "shoal_returned" not in exported
    assert "shoal_batch_seconds_bucket" in exported and "shoal_batch_seconds" not in exported
    assert "shoal_runtime_restarts" in exported  # a gauge: no _total
    assert "shoal_runtime_restarts_total" not in exported
    assert "shoal_broker_connected" in exported and "shoal_gateway_broker_connected" in exported
    wrong = metric_names("sum(rate(shoal_model_load_total[5m]))")  # loads, not load
    assert wrong - exported == {"shoal_model_load_total"}


def test_metric_modules_load_no_model_code():
    assert _probe()["heavy"] == []


# --- the dashboard ---------------------------------------------------------------------

def test_every_dashboard_query_uses_exported_metrics():
    exported = exported_series() | RABBITMQ_METRICS
    unknown = {}
    for where, expr, grafana in dashboard_exprs():
        names = metric_names(expr, grafana=grafana)
        assert names, f"{where} queries no metric"
        missing = names - exported
        if missing:
            unknown[where] = sorted(missing)
    assert unknown == {}


def test_the_dashboard_is_well_formed():
    board = dashboard()
    assert board["schemaVersion"] >= 38
    assert board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["type"] == "query"
    panels = _panels(board["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['id']} {panel['title']!r} has no target"
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["expr"].strip()
            assert target["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))


def test_the_dashboard_covers_what_operators_watch():
    used = set()
    for _, expr, grafana in dashboard_exprs():
        used |= metric_names(expr, grafana=grafana)
    for needed in ("rabbitmq_detailed_queue_messages_ready", "shoal_queue_wait_seconds_bucket",
                   "shoal_batch_fill_ratio_bucket", "shoal_batch_items_sum",
                   "shoal_batch_seconds_sum", "shoal_device_busy_seconds_total",
                   "shoal_gateway_request_seconds_bucket",
                   "shoal_returned_total", "shoal_expired_total", "shoal_model_loads_total",
                   "shoal_model_evictions_total", "shoal_dead_lettered_total",
                   "shoal_runtime_restarts", "shoal_runtime_spare_promotions",
                   "shoal_poison_isolated", "shoal_broker_connected",
                   "shoal_gateway_broker_connected", "shoal_worker_draining",
                   "shoal_shutdown_forced_total", "shoal_gateway_edge_refusals_total",
                   "shoal_gateway_auth_refusals_total",
                   "shoal_gateway_unexpected_errors_total"):
        assert needed in used, needed


# --- the alert rules -------------------------------------------------------------------

def test_every_rule_uses_exported_metrics():
    exported = exported_series() | RABBITMQ_METRICS
    unknown = {where: sorted(metric_names(expr) - exported) for where, expr in rule_exprs()}
    assert {where: names for where, names in unknown.items() if names} == {}


_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def test_the_rules_file_is_a_prometheus_rules_file():
    doc = rules()
    assert set(doc) == {"groups"}
    group_names = [g["name"] for g in doc["groups"]]
    assert len(group_names) == len(set(group_names))
    alerts = []
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "limit", "rules"}
        assert group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels",
                                 "annotations"}, rule
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert _DURATION.match(str(rule["for"])), rule["alert"]
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}
            description = rule["annotations"]["description"]
            assert len(description.split()) >= 8, rule["alert"]
            assert rule["annotations"]["summary"]
            alerts.append(rule["alert"])
    assert len(alerts) == len(set(alerts))


def test_the_rules_cover_the_issue():
    used = {}
    for where, expr in rule_exprs():
        for name in metric_names(expr):
            used.setdefault(name, []).append(where)
    for needed in ("shoal_queue_wait_seconds_bucket", "shoal_dead_lettered_total",
                   "shoal_runtime_restarts", "shoal_poison_isolated", "shoal_broker_connected",
                   "shoal_gateway_broker_connected", "shoal_shutdown_forced_total",
                   "shoal_gateway_unexpected_errors_total",
                   "shoal_gateway_rate_limit_local_total"):
        assert needed in used, needed
