"""The planner's I/O for one InferenceService with spec.autoscaling (no Prometheus needed).

The operator's work queue runs a planning pass for each autoscaled service every intervalSeconds
(tandem.operator.controller). Such a pass:

  1. observes the service's pods and GETs /metrics of its ready router and worker pods at their pod
     IPs (and the workers' KV health, for the status it writes), concurrently, each within a timeout
     and a size limit (tandem.operator.probe);
  2. adds the round to the service's MetricsWindow and asks plan() for a decision (here);
  3. acts in the same pass, on the read of the InferenceService it started with: for a scale-down it
     first marks the pods the planner chose (lowest pod-deletion-cost: the ReplicaSet removes exactly
     those), then applies the Deployments with the new counts and writes the decision into status once
     (per role the desired replicas, a reason and a message; the Autoscaling condition), and posts an
     Event for each change of desired replicas (tandem.operator.reconcile). A removed decode pod's
     running streams are not lost: on the kubelet's SIGTERM its worker hands each sequence, its KV
     leased, to another decode worker through the router (docs/autoscaling.md).

The desired replicas live in status, so they survive a restart and a failover to the other operator
replica. What lives only in the operator (the metrics window, the recent recommendations, what the
planner learned) starts afresh: the first pass only collects, and the stabilisation history starts at
the current count, so no scale-down comes sooner than scaleDown.stabilizationWindowSeconds after a
restart. A role in External mode needs no planning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import aiohttp
from tandem.contracts.names import pod_ready, pod_url
from tandem.operator import probe
from tandem.operator.config import OperatorConfig
from tandem.operator.spec import COMPONENTS, AutoscalingSpec, InferenceServiceSpec
from tandem.operator.status import Observation
from tandem.planning.autoscaling.planner import Decision, PlannerState, plan
from tandem.planning.autoscaling.snapshot import MetricsWindow, ScrapeRound, Snapshot

METRICS_PATH = "/metrics"


@dataclass
class Planning:
    """What the planner keeps between the passes of one service (never in status: it may be lost)."""

    uid: str | None = None  # a service deleted and created again under the name starts afresh
    window: MetricsWindow | None = None
    state: PlannerState | None = None
    snapshot: Snapshot | None = None  # what the last decision was made from (the operator's metrics show it)


async def autoscale(planning: Planning, uid: str | None, spec: InferenceServiceSpec, obs: Observation,
                    config: OperatorConfig, session: aiohttp.ClientSession | None = None
                    ) -> Decision | None:
    """One decision for one service from its pods' metrics (None: nothing to decide). Updates
    `planning` in place."""
    a = spec.autoscaling
    if a is None or not any(a.owns(role) for role in a.roles):
        return None  # External only: status reports what the Deployments run
    if uid != planning.uid or (planning.window is not None and planning.window.window_s != a.window_s):
        planning.uid, planning.window, planning.state = uid, None, None
    if any(role not in obs.roles for role in a.roles):
        return None  # the Deployments are not there yet: the apply creates them first
    stamp = time.monotonic()
    scrape = await scrape_round(obs, stamp, config.metrics_timeout_s, session)
    planning.window = (planning.window or MetricsWindow(float(a.window_s))).add(scrape)
    current = {role: obs.roles[role].replicas for role in a.roles}
    seeded = _seeded(planning.state, a, current, stamp)
    planning.snapshot = planning.window.snapshot()
    decision, planning.state = plan(planning.snapshot, current, a, seeded, stamp)
    return decision


def _seeded(state: PlannerState | None, spec: AutoscalingSpec, current: dict[str, int], stamp: float) -> PlannerState:
    """A role the planner has no history of (a new service or role, a restarted operator) starts
    with the current count as its first recommendation: a scale-down waits a whole window."""
    state = state or PlannerState()
    # Just before now: outside a scale-up window of 0 s, inside any scale-down window.
    fresh = {role: ((stamp - 1e-3, current[role]),) for role in spec.roles if spec.owns(role) and role not in state.history}
    return replace(state, history={**state.history, **fresh}) if fresh else state


async def scrape_round(obs: Observation, stamp: float, timeout_s: float,
                       session: aiohttp.ClientSession | None = None) -> ScrapeRound:
    """GET /metrics of every ready router, prefill and decode pod; a pod not ready or without an IP
    is listed unread (the planner counts only ready pods, and says which it could not read)."""
    pods: list[tuple[str, str, bool, str | None]] = []
    for role in COMPONENTS:
        ro = obs.roles.get(role)
        for pod in ro.pods if ro is not None else []:
            url = pod_url(pod)
            ready = pod_ready(pod)
            pods.append((pod["metadata"]["name"], role, ready, url + METRICS_PATH if ready and url else None))
    return ScrapeRound(stamp, tuple(await probe.read_metrics(pods, timeout_s, session)))

