"""The Grafana dashboard shows TTFT, inter-token latency, throughput, KV transfer bandwidth
and failures per InferenceService, and the operator's own reconciles, queue, planner and scrape
failures; every series it queries is one the router, the workers or the operator really export
(names read from their source, so a rename breaks this test)."""

from __future__ import annotations

import json
import re

from tandem.testing.chart import CHART_DIR, REPO_ROOT

DASHBOARD = CHART_DIR / "files" / "dashboard.json"
REQUIRED = {
    "tandem_time_to_first_token_seconds",
    "tandem_inter_token_latency_seconds",
    "tandem_e2e_request_latency_seconds",
    "tandem_worker_generation_tokens_total",
    "tandem_kv_transfer_bytes_total",
    "tandem_kv_transfer_seconds",
    "tandem_kv_transfer_failures_total",
    "tandem_operator_reconciles_total",
    "tandem_operator_reconcile_errors_total",
    "tandem_operator_reconcile_duration_seconds",
    "tandem_operator_queue_depth",
    "tandem_operator_planner_decisions_total",
    "tandem_operator_planner_input",
    "tandem_operator_scrape_failures_total",
}
# Operator-wide panels: the operator's own work, not one InferenceService's.
OPERATOR_WIDE = {"Operator: reconciles", "Operator: reconcile errors", "Operator: reconcile latency",
                 "Operator: work queue and leader", "Operator: pod scrape failures"}


def exported_metric_names() -> set[str]:
    """Metric names defined in worker/, router/ and operator/, as Prometheus exposes them: a
    counter's name gets `_total` whether or not the code spells it."""
    names: set[str] = set()
    for path in (p for folder in ("worker", "router", "operator") for p in (REPO_ROOT / folder).rglob("*.py")):
        text = path.read_text()
        for kind, name in re.findall(
            r"(Counter|CounterMetricFamily|Histogram|HistogramMetricFamily|Gauge|"
            r"GaugeMetricFamily|Summary)\(\s*\"(tandem_[a-z0-9_]+)\"", text
        ):
            if kind.startswith("Counter"):
                name = name.removesuffix("_total") + "_total"
            names.add(name)
    return names


def queried_metric_names(dashboard: dict) -> set[str]:
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\btandem_[a-z0-9_]+", target["expr"]):
                names.add(re.sub(r"_(bucket|count|sum)$", "", name))
    return names


def test_dashboard_is_valid_json_with_per_service_variables() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "inferenceservice"} <= variables
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert OPERATOR_WIDE <= {p["title"] for p in dashboard["panels"]}
    for panel in dashboard["panels"]:
        if panel["title"] in OPERATOR_WIDE:
            continue
        for target in panel["targets"]:
            # Per InferenceService: every query is filtered and grouped by it.
            assert 'inferenceservice=~"$inferenceservice"' in target["expr"], panel["title"]
            assert "inferenceservice" in target["legendFormat"], panel["title"]


def test_dashboard_covers_latency_throughput_and_kv_transfer() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert REQUIRED <= queried_metric_names(dashboard)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for word in ("first token", "inter-token", "throughput", "bandwidth", "failures"):
        assert word in titles


def test_every_queried_metric_is_exported_by_the_code() -> None:
    exported = exported_metric_names()
    assert REQUIRED <= exported, f"not exported by the code: {sorted(REQUIRED - exported)}"
    missing = queried_metric_names(json.loads(DASHBOARD.read_text())) - exported
    assert not missing, f"the dashboard queries series nobody exports: {sorted(missing)}"
