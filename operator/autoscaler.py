"""The planner in the operator: one decision per intervalSeconds for every InferenceService with
spec.autoscaling, from the router's and workers' own /metrics (no Prometheus needed).

One operator-wide asyncio task (as the resync is: a kopf timer would add a finalizer) wakes for
whichever service is due next. A tick:

  1. observes the service's pods and GETs /metrics of its ready router and worker pods at their pod
     IPs (and the workers' KV health, for the status it writes), concurrently, each within a timeout;
  2. adds the round to the service's MetricsWindow and asks plan() for a decision;
  3. acts under the service's reconcile lock, on a fresh read of the InferenceService: for a
     scale-down it first marks the pods the planner chose (lowest pod-deletion-cost: the ReplicaSet
     removes exactly those), then writes the decision into status (per role the desired replicas, a
     reason and a message; the Autoscaling condition), posts an Event for each change of desired
     replicas, and reconciles, which applies the Deployments with the new counts. A removed decode
     pod's running streams are not lost: on the kubelet's SIGTERM its worker hands each sequence,
     its KV leased, to another decode worker through the router (docs/autoscaling.md).

The desired replicas live in status, so they survive a restart. What lives only here (the metrics
window, the recent recommendations, what the planner learned) starts afresh: the first tick only
collects, and the stabilisation history starts at the current count, so no scale-down comes sooner
than scaleDown.stabilizationWindowSeconds after a restart. A role in External mode needs no tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from kubernetes import client
from tandem.contracts.names import pod_ready, pod_url
from tandem.operator import apply, probe
from tandem.operator.autoscaling.planner import Decision, PlannerState, plan
from tandem.operator.autoscaling.snapshot import MetricsWindow, PodScrape, ScrapeRound, read_pod
from tandem.operator.autoscaling.status import kept_replicas
from tandem.operator.config import OperatorConfig
from tandem.operator.group_pods import removed_by_scale_down
from tandem.operator.reconcile import now, parse_spec, reconcile_locked, service_lock, write_status
from tandem.operator.spec import COMPONENTS, AutoscalingSpec
from tandem.operator.status import KVProbe, Observation

log = logging.getLogger(__name__)
METRICS_PATH = "/metrics"
IDLE_WAKE_S = 60.0  # with nothing to plan, look again this often (track() wakes it sooner)
RETRY_S = 5.0  # a tick that failed before it read the spec's interval runs again after this


@dataclass
class Tracked:
    """One autoscaled InferenceService: when it is due, and what the planner keeps between ticks."""

    namespace: str
    name: str
    uid: str | None = None  # a service deleted and created again under the name starts afresh
    due: float = 0.0  # time.monotonic()
    window: MetricsWindow | None = None
    state: PlannerState | None = None


class Autoscaler:
    """The InferenceServices with spec.autoscaling, and the loop that plans for them."""

    def __init__(self, api: client.ApiClient, config: OperatorConfig) -> None:
        self.api, self.config = api, config
        self.services: dict[tuple[str, str], Tracked] = {}
        self.wake = asyncio.Event()

    def track(self, body: dict) -> None:
        """Every InferenceService the operator reconciles passes here: one with spec.autoscaling
        is planned for from now on (a tick drops it once the spec no longer asks)."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if not (body.get("spec") or {}).get("autoscaling") or meta.get("deletionTimestamp"):
            self.services.pop(key, None)
        elif key not in self.services:
            self.services[key] = Tracked(*key, uid=meta.get("uid"), due=time.monotonic())
            self.wake.set()

    async def run_forever(self) -> None:
        """Ticks every service that is due (all at once: a slow one delays the others by at most its
        timeouts), then sleeps until the next is due or a new service is tracked."""
        while True:
            due = [t for t in self.services.values() if t.due <= time.monotonic()]
            results = await asyncio.gather(*(self.tick(t) for t in due), return_exceptions=True)
            for t, result in zip(due, results, strict=True):
                if isinstance(result, BaseException):
                    log.error("autoscaling %s/%s failed: %s", t.namespace, t.name, result, exc_info=result)
            self.wake.clear()
            soonest = min((t.due for t in self.services.values()), default=time.monotonic() + IDLE_WAKE_S)
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=max(0.05, soonest - time.monotonic()))
            except TimeoutError:
                pass

    async def tick(self, t: Tracked) -> Decision | None:
        """One decision for one service, acted on; None when there was nothing to decide."""
        t.due = time.monotonic() + RETRY_S  # until the spec says its interval (an API error retries)
        body = await asyncio.to_thread(apply.get_service, self.api, t.namespace, t.name)
        spec, _ = parse_spec(body) if body is not None else (None, None)
        if body is None or body["metadata"].get("deletionTimestamp") or spec is None or spec.autoscaling is None:
            self.services.pop((t.namespace, t.name), None)
            return None
        a = spec.autoscaling
        t.due = time.monotonic() + a.interval_s
        if body["metadata"].get("uid") != t.uid or (t.window is not None and t.window.window_s != a.window_s):
            t.uid, t.window, t.state = body["metadata"].get("uid"), None, None
        if not any(a.owns(role) for role in a.roles):
            return None  # External only: reconcile reports what the Deployments run
        obs = await asyncio.to_thread(apply.observe, self.api, t.namespace, t.name)
        if any(role not in obs.roles for role in a.roles):
            return None  # the Deployments are not there yet: reconcile creates them first
        stamp = time.monotonic()
        scrape, kv = await asyncio.gather(scrape_round(obs, stamp, self.config.metrics_timeout_s),
                                          self._probe_kv(obs))
        t.window = (t.window or MetricsWindow(float(a.window_s))).add(scrape)
        current = {role: obs.roles[role].replicas for role in a.roles}
        decision, t.state = plan(t.window.snapshot(), current, a, _seeded(t.state, a, current, stamp), stamp)
        await asyncio.to_thread(act, self.api, t.namespace, t.name, decision, obs, self.config, kv)
        return decision

    async def _probe_kv(self, obs: Observation) -> list[KVProbe] | None:
        if not self.config.kv_probe:
            return None
        return await probe.probe_all(probe.targets(obs), self.config.kv_probe_timeout_s)


def _seeded(state: PlannerState | None, spec: AutoscalingSpec, current: dict[str, int], stamp: float) -> PlannerState:
    """A role the planner has no history of (a new service or role, a restarted operator) starts
    with the current count as its first recommendation: a scale-down waits a whole window."""
    state = state or PlannerState()
    # Just before now: outside a scale-up window of 0 s, inside any scale-down window.
    fresh = {role: ((stamp - 1e-3, current[role]),) for role in spec.roles if spec.owns(role) and role not in state.history}
    return replace(state, history={**state.history, **fresh}) if fresh else state


async def scrape_round(obs: Observation, stamp: float, timeout_s: float) -> ScrapeRound:
    """GET /metrics of every ready router, prefill and decode pod; a pod not ready or without an IP
    is listed unread (the planner counts only ready pods, and says which it could not read)."""
    pods: list[tuple[str, str, bool, str | None]] = []
    for role in COMPONENTS:
        ro = obs.roles.get(role)
        for pod in ro.pods if ro is not None else []:
            url = pod_url(pod)
            ready = pod_ready(pod)
            pods.append((pod["metadata"]["name"], role, ready, url + METRICS_PATH if ready and url else None))
    answers = iter(await probe.get_all([url for *_, url in pods if url is not None], timeout_s))
    out: list[PodScrape] = []
    for name, role, ready, url in pods:
        text, error = next(answers) if url is not None else (None, "not ready" if not ready else "no pod IP")
        out.append(read_pod(name, role, ready, text, error))
    return ScrapeRound(stamp, tuple(out))


def act(api: client.ApiClient, namespace: str, name: str, decision: Decision, obs: Observation,
        config: OperatorConfig, kv_probes: list[KVProbe] | None) -> None:
    """Writes `decision` into status and applies it, on a fresh read of the InferenceService."""
    with service_lock(namespace, name):
        body = apply.get_service(api, namespace, name)
        spec, _ = parse_spec(body) if body is not None else (None, None)
        if body is None or body["metadata"].get("deletionTimestamp") or spec is None or spec.autoscaling is None:
            return
        old, changes = body.get("status") or {}, []
        for role, d in decision.roles.items():
            if not spec.autoscaling.owns(role):
                continue
            kept = kept_replicas(spec, old, role)
            if d.desired == kept:
                continue
            message = f"{role} {d.message} [{d.reason}]" if d.current == kept else (
                f"{role} {kept} -> {d.desired} [{d.reason}]: {d.message}")
            if d.desired < kept and obs.roles[role].group_size > 1:
                # Groups go by index, highest first, whatever the planner preferred.
                d = replace(d, remove=removed_by_scale_down(obs.roles[role].pods, d.desired))
            if d.desired < kept and d.remove:
                # The pods to go are known and marked before replicas drop. Their running streams
                # move when the kubelet's SIGTERM reaches them: each decode worker hands its
                # sequences (their KV leased) to other decode workers through the router.
                problems = apply.mark_for_removal(api, namespace, obs.roles[role].pods, d.remove, now())
                message += f"; removing {', '.join(d.remove)}"
                if problems:
                    message += f" (could not mark {'; '.join(problems)}: the ReplicaSet picks instead)"
            changes.append(("ScaledUp" if d.desired > kept else "ScaledDown", message))
        body["status"] = write_status(api, body, config, kv_probes, decision)
        for reason, message in changes:
            log.info("%s/%s: %s", namespace, name, message)
            apply.post_event(api, body, "Normal", reason, message)
        if changes:
            # Quiet about the Deployments it scales (the events above say it), not about a new spec.
            fresh_spec = old.get("observedGeneration") != body["metadata"].get("generation")
            reconcile_locked(api, body, config, kv_probes=kv_probes, announce=fresh_spec)
