"""The operator's own Prometheus metrics (prefix tandem_operator_), served on /metrics next to the
liveness probe (tandem.operator.endpoints) by every replica, standby or leader.

Per InferenceService series carry `namespace` and `inferenceservice` (bounded by the services, and
removed with them by `forget`); nothing is labelled per request or per pod.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from tandem.planning.autoscaling.planner import Decision
from tandem.planning.autoscaling.snapshot import Snapshot

PASS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# What the planner read, per role, as gauges (the snapshot it decided from).
INPUTS = ("ready", "readable", "running", "waiting", "kv_usage", "busy", "prompt_tokens_rate")


class OperatorMetrics:
    """Every series the operator exports, on one registry (the process's default in production)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.reconciles = Counter(
            "tandem_operator_reconciles_total", "Passes over an InferenceService, by who asked for it.",
            ["trigger"], registry=registry)
        self.reconcile_errors = Counter(
            "tandem_operator_reconcile_errors_total",
            "Passes that ended in an error: ApplyFailed, AdoptionRefused, InvalidSpec, or Exception (a bug or "
            "an unreachable API server).", ["trigger", "reason"], registry=registry)
        self.reconcile_seconds = Histogram(
            "tandem_operator_reconcile_duration_seconds", "Time one pass took (read, plan, apply, status).",
            ["trigger"], buckets=PASS_BUCKETS, registry=registry)
        self.queue_depth = Gauge(
            "tandem_operator_queue_depth", "InferenceServices waiting for a pass (timers not counted).",
            registry=registry)
        self.queue_active = Gauge("tandem_operator_queue_active", "Passes running now.", registry=registry)
        self.queue_wait = Histogram(
            "tandem_operator_queue_wait_seconds", "Time from queued to the start of its pass.",
            buckets=PASS_BUCKETS, registry=registry)
        self.services = Gauge(
            "tandem_operator_services", "InferenceServices the operator keeps state for.", registry=registry)
        self.leader = Gauge(
            "tandem_operator_leader", "1 while this replica runs the operator (holds the Lease, or runs without "
            "leader election), 0 while it stands by.", registry=registry)
        self.decisions = Counter(
            "tandem_operator_planner_decisions_total",
            "Planner decisions per role: direction up, down or hold, and the one-word reason.",
            ["namespace", "inferenceservice", "role", "direction", "reason"], registry=registry)
        self.desired = Gauge(
            "tandem_operator_planner_desired_replicas", "The planner's last desired replicas per role.",
            ["namespace", "inferenceservice", "role"], registry=registry)
        self.inputs = Gauge(
            "tandem_operator_planner_input",
            "What the planner read for its last decision, per role: " + ", ".join(INPUTS) + " (summed over the "
            "role's readable pods; kv_usage a fraction, busy in replica-equivalents, rates per second).",
            ["namespace", "inferenceservice", "role", "input"], registry=registry)
        self.api_requests = Counter(
            "tandem_operator_api_requests_total", "Calls to the Kubernetes API server, by HTTP method.",
            ["method"], registry=registry)
        self.api_seconds = Histogram(
            "tandem_operator_api_request_duration_seconds", "Time one call to the API server took.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=registry)
        self.scrape_failures = Counter(
            "tandem_operator_scrape_failures_total",
            "Pod answers the operator could not use: what it asked (metrics, kv_health) and why (timeout, "
            "refused, http_status, redirect, too_large, compressed, unreadable).", ["kind", "reason"], registry=registry)

        self._per_service: dict[tuple[str, str], set[tuple[Counter | Gauge, tuple[str, ...]]]] = {}

    def _of(self, metric: Counter | Gauge, *labels: str) -> Counter | Gauge:
        """metric.labels(*labels), remembered under its service (the first two labels) for forget()."""
        self._per_service.setdefault((labels[0], labels[1]), set()).add((metric, labels))
        return metric.labels(*labels)

    def decided(self, namespace: str, name: str, decision: Decision, snapshot: Snapshot | None) -> None:
        """One planner decision and the snapshot it was made from."""
        for role, d in decision.roles.items():
            if not d.owned:
                continue
            direction = "up" if d.desired > d.current else "down" if d.desired < d.current else "hold"
            self._of(self.decisions, namespace, name, role, direction, d.reason.value).inc()
            self._of(self.desired, namespace, name, role).set(d.desired)
            rw = snapshot.roles.get(role) if snapshot is not None else None
            for key in INPUTS if rw is not None else ():
                value = rw.kv_usage if key == "kv_usage" else getattr(rw, key)
                if value is not None:
                    self._of(self.inputs, namespace, name, role, key).set(float(value))

    def forget(self, namespace: str, name: str) -> None:
        """Drops the series of a deleted InferenceService."""
        for metric, labels in self._per_service.pop((namespace, name), set()):
            metric.remove(*labels)


def failure_reason(error: str) -> str:
    """A bounded label for why a pod answer was unusable (tandem.operator.probe's wording)."""
    for needle, reason in (("in time", "timeout"), ("more than", "too_large"), ("Content-Encoding", "compressed"),
                           ("a redirect", "redirect"), ("HTTP ", "http_status"), ("no KV health document", "unreadable"),
                           ("lack", "unreadable"), ("not Prometheus", "unreadable")):
        if needle in error:
            return reason
    return "refused"


METRICS = OperatorMetrics()  # the process's: prometheus_client registers each name once per registry
