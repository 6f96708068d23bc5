"""Observed children -> the InferenceService's status. Pure: the caller passes the clock.

Conditions (type, status, CamelCase reason, message, lastTransitionTime, observedGeneration):
  PrefillReady, DecodeReady, RouterReady  from each Deployment and its pods; a pod the scheduler
                                          cannot place surfaces as reason Unschedulable with the
                                          scheduler's own message
  HandoffVerified                         from the routers' handoff parity probes
                                          (tandem.operator.handoff_condition)
  KVTransferReady                         from every ready prefill/decode pod's KV health as
                                          its routers report it (kv_condition): True Healthy; False
                                          TransferFailing / RDMAFallback / BandwidthBelowFloor;
                                          Unknown Unreachable / NoWorkers / NotProbed (probing off) /
                                          NotApplicable (runtime vllm: no such report)
  Ready                                   True when the three roles are; otherwise the most
                                          actionable failing reason (Unschedulable first);
                                          ApplyFailed when the API server refuses a child,
                                          AdoptionRefused when another owner holds one;
                                          InvalidSpec when the operator cannot read the spec
                                          (the roles then report against what is running)
                                          KVTransferReady does not feed it: Ready is about serving
                                          capacity (a fallen-back path still serves, slowly)
  Autoscaling                             only with spec.autoscaling (tandem.operator.autoscaling.status):
                                          Active / LimitedByMax / LimitedByMin / MetricsUnavailable /
                                          CollectingMetrics / External
  GatewayReady                            only with spec.gateway.enabled (gateway_condition): True
                                          PickerReady; False GatewayAPIMissing (the gateway's CRDs
                                          are not installed) / PickerMissing / PickerNotReady or a
                                          picker pod's problem (Unschedulable, ...)
lastTransitionTime changes only when a condition's status changes.

Per component status says the desired pods (`replicas`), what its Deployment asks for now
(`currentReplicas`) and how many are ready; an autoscaled role adds who decides (`mode`), why (a
one-word `reason` and a `message`) and when the desired count last changed (`lastScaleTime`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.contracts.gateway import PICKER
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import Role, serves_requests
from tandem.contracts.runtimes import Runtime
from tandem.operator import kv_bandwidth
from tandem.operator.group_pods import ready_groups
from tandem.operator.handoff_condition import RouterParity, handoff_condition
from tandem.operator.spec import COMPONENTS, ROUTER, InferenceServiceSpec

CONDITION_FOR = {Role.PREFILL.value: "PrefillReady", Role.DECODE.value: "DecodeReady", ROUTER: "RouterReady"}


@dataclass
class RoleObservation:
    """What the API server says about one role's Deployment (or LeaderWorkerSet) and its pods.

    For a LeaderWorkerSet, replicas and ready count groups, `pods` are the groups' leaders (the pods
    that take requests) and `followers` the other pods; `group_size` is pods per group (1 otherwise).
    """

    exists: bool = False
    replicas: int = 0  # the workload's spec.replicas as applied
    ready: int = 0  # ready replicas (for groups: groups whose every pod is ready)
    pods: list[dict[str, Any]] = field(default_factory=list)
    followers: list[dict[str, Any]] = field(default_factory=list)
    group_size: int = 1


def role_observation(workload: dict[str, Any], pods: list[dict[str, Any]]) -> RoleObservation:
    """One role from its workload (a Deployment or a LeaderWorkerSet) and its live pods."""
    spec = workload.get("spec") or {}
    replicas = spec.get("replicas")
    if workload.get("kind") != "LeaderWorkerSet":
        return RoleObservation(True, replicas or 0, (workload.get("status") or {}).get("readyReplicas") or 0,
                               pods)
    size = int((spec.get("leaderWorkerTemplate") or {}).get("size") or 1)
    leaders = [p for p in pods if serves_requests(p)]
    return RoleObservation(True, 1 if replicas is None else replicas, ready_groups(pods, size), leaders,
                           [p for p in pods if not serves_requests(p)], size)


@dataclass
class KVProbe:
    """One worker pod's KV health as its routers report it (tandem.operator.router_parity.worker_health;
    health None when none did, `error` says why)."""

    pod: str
    role: str
    health: KVHealth | None = None
    error: str | None = None  # why no router reported its health


@dataclass
class Observation:
    roles: dict[str, RoleObservation] = field(default_factory=dict)
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)  # "Kind/name" -> the object as listed
    router_service: bool = False
    apply_error: str | None = None  # why the last apply failed, if it did
    apply_reason: str = "ApplyFailed"  # Ready's reason for it (AdoptionRefused: another owner holds a child)
    spec_error: str | None = None  # why the operator cannot use the spec (tandem.operator.spec.SpecError)
    kv_probes: list[KVProbe] | None = None  # None: the operator does not probe (--no-kv-probe)
    parity: list[RouterParity] | None = None  # the routers' handoff parity reports (None: not probed)


@dataclass(frozen=True)
class ScaledRole:
    """An autoscaled role's desired pods and why: the planner's decision, or the external autoscaler's
    count in External mode."""

    desired: int
    mode: str  # Operator | External
    reason: str
    message: str
    last_scale_time: str | None = None


@dataclass(frozen=True)
class Scaling:
    """What status says of spec.autoscaling: per autoscaled role, and the Autoscaling condition."""

    roles: dict[str, ScaledRole]
    condition: dict[str, str]


def condition(type_: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": status, "reason": reason, "message": message}


def _pod_problem(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The most telling reason a role's pods are not ready: unschedulable first, then containers."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                name = pod["metadata"]["name"]
                return "Unschedulable", f"pod {name} cannot be scheduled: {cond.get('message', '')}"
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in (
                "CrashLoopBackOff",
                "ImagePullBackOff",
                "ErrImagePull",
                "CreateContainerConfigError",
                "InvalidImageName",
            ):
                name = pod["metadata"]["name"]
                msg = waiting.get("message") or waiting["reason"]
                return waiting["reason"], f"pod {name}: {msg}"
    return None


def role_condition(role: str, obs: RoleObservation, desired: int) -> dict[str, str]:
    """One role's readiness condition from its workload and pods (for groups: every pod of a group)."""
    type_ = CONDITION_FOR[role]
    if not obs.exists:
        return condition(type_, "False", "DeploymentMissing", f"the {role} Deployment does not exist yet")
    if desired == 0 and role == Role.PREFILL.value:
        # A valid way to serve (the autoscaler may choose it): decode workers prefill themselves.
        return condition(type_, "True", "ScaledToZero", "no prefill pods wanted: decode workers prefill prompts")
    if desired == 0:
        return condition(type_, "False", "ScaledToZero", f"{role}.replicas is 0")
    unit = "pods" if obs.group_size == 1 else f"groups ({obs.group_size} pods each, ready when all are)"
    if obs.ready >= desired:
        return condition(type_, "True", "AllReplicasReady", f"{obs.ready}/{desired} {role} {unit} ready")
    problem = _pod_problem(obs.pods + obs.followers)
    if problem and problem[0] == "Unschedulable" and obs.group_size > 1:
        # The scheduler speaks of one pod; the numbers that matter are the group's.
        problem = (problem[0], f"a {role} group needs {obs.group_size} distinct nodes of its pool, each with "
                   f"room for one of its pods; {problem[1]}")
    if obs.ready > 0:
        msg = f"{obs.ready}/{desired} {role} {unit} ready"
        if problem:
            msg += f"; {problem[1]}"
        return condition(type_, "True", "MinimumReplicasReady", msg)
    if problem:
        return condition(type_, "False", problem[0], problem[1])
    return condition(type_, "False", "PodsNotReady",
                     f"0/{desired} {role} {unit} ready (starting or loading the model)")


def gateway_condition(spec: InferenceServiceSpec | None, obs: Observation) -> list[dict[str, str]]:
    """`GatewayReady` with spec.gateway (none without): the InferencePool and the picker applied, and a
    picker pod ready. Where the cluster lacks the gateway's CRDs the apply says so (InferencePool's
    or HTTPRoute's API not installed: `GatewayAPIMissing`)."""
    if spec is None or not spec.gateway.enabled:
        return []
    type_ = "GatewayReady"
    error = obs.apply_error or ""
    if ("InferencePool" in error or "HTTPRoute" in error) and "is not installed" in error:
        return [condition(type_, "False", "GatewayAPIMissing", error)]
    picker = obs.roles.get(PICKER, RoleObservation())
    desired = spec.gateway.picker_replicas
    if not picker.exists:
        return [condition(type_, "False", "PickerMissing", "the endpoint picker's Deployment does not exist yet")]
    if picker.ready == 0:
        problem = _pod_problem(picker.pods)
        reason, message = problem or ("PickerNotReady", f"0/{desired} endpoint picker pods ready (a picker is "
                                      "ready once it can route to a decode worker)")
        return [condition(type_, "False", reason, message)]
    return [condition(type_, "True", "PickerReady",
                      f"InferencePool applied, {picker.ready}/{desired} endpoint picker pods ready")]


# Ready's reason when several roles fail: the first of these that applies; others in between.
URGENCY = ("Unschedulable", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
           "CreateContainerConfigError", "CrashLoopBackOff")
LEAST_URGENT = ("DeploymentMissing", "PodsNotReady", "ScaledToZero")


def _urgency(reason: str) -> int:
    if reason in URGENCY:
        return URGENCY.index(reason)
    if reason in LEAST_URGENT:
        return 100 + LEAST_URGENT.index(reason)
    return 50


def desired_replicas(spec: InferenceServiceSpec | None, obs: Observation,
                     scaling: Scaling | None = None) -> dict[str, int]:
    """Pods per component: as the spec (or, for an autoscaled role, `scaling`) asks, or as the
    Deployments say when the spec is unreadable."""
    if spec is not None:
        planned = {role: sr.desired for role, sr in (scaling.roles if scaling else {}).items()}
        return spec.replicas() | planned
    return {c: obs.roles[c].replicas if c in obs.roles else 0 for c in COMPONENTS}


def compute_conditions(spec: InferenceServiceSpec | None, obs: Observation,
                       scaling: Scaling | None = None,
                       model: dict[str, str] | None = None) -> list[dict[str, str]]:
    """All conditions, without timestamps: Ready first, then per role, then KVTransferReady, then
    ModelReady (when known: tandem.operator.model_check), then Autoscaling when the spec asks for it.
    A model that cannot be served (ModelReady False) makes Ready False with its reason."""
    desired = desired_replicas(spec, obs, scaling)
    roles = [role_condition(r, obs.roles.get(r, RoleObservation()), desired[r]) for r in COMPONENTS]
    if obs.spec_error:
        ready = condition("Ready", "False", "InvalidSpec", obs.spec_error)
    elif model is not None and model["status"] == "False":
        ready = condition("Ready", "False", model["reason"], model["message"])
    elif obs.apply_error:
        ready = condition("Ready", "False", obs.apply_reason, obs.apply_error)
    else:
        failing = [c for c in roles if c["status"] != "True"]
        if not failing:
            ready = condition("Ready", "True", "AllComponentsReady", "prefill, decode and router are ready")
        else:
            # The reason a person can act on wins (a pod that cannot be placed over one starting).
            reason = min((c["reason"] for c in failing), key=_urgency)
            ready = condition("Ready", "False", reason, "; ".join(c["message"] for c in failing))
    autoscaling = [scaling.condition] if scaling is not None else []
    return [ready, *roles, kv_condition(spec, obs.kv_probes), handoff_condition(obs, obs.parity),
            *([model] if model else []), *autoscaling, *gateway_condition(spec, obs)]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def kv_condition(spec: InferenceServiceSpec | None, probes: list[KVProbe] | None) -> dict[str, str]:
    """KVTransferReady from the workers' own health reports; the worst finding wins.

    Order: TransferFailing (requests fail now), RDMAFallback (slow, silently), BandwidthBelowFloor (a
    worker measured less than kvTransfer.minBandwidthGBps: tandem.operator.kv_bandwidth), Unreachable,
    NoWorkers, Healthy (with the bandwidth measured per transport). Each message names the pods so
    `kubectl describe` points at them. RDMAFallback and the floor need the spec; without a readable
    one they are not judged.
    """
    type_ = "KVTransferReady"
    if spec is not None and spec.runtime.name is not Runtime.TANDEM:
        return condition(type_, "Unknown", "NotApplicable",
                         f"runtime {spec.runtime.name.value}: its servers report no KV transfer health (Tandem's "
                         "/internal/kv/health), so the operator does not probe them; vLLM's NixlConnector counts "
                         "its transfers in the servers' own /metrics")
    if probes is None:
        return condition(type_, "Unknown", "NotProbed",
                         "the operator does not probe KV transfer (--no-kv-probe); "
                         "see the workers' /internal/kv/health")
    if not probes:
        return condition(type_, "Unknown", "NoWorkers", "no prefill or decode pod is ready to probe")
    # A worker still loading its model (or run with --kv-backend none) answers without a transport.
    answered = [p for p in probes if p.health is not None and p.health.healthy is not None]
    failing = [p for p in answered if p.health.healthy is False]
    if failing:
        parts = [f"pod {p.pod} ({p.role}): {_plural(p.health.failures, 'failed transfer')}, "
                 f"last error: {p.health.last_error or 'unknown'}" for p in failing]
        return condition(type_, "False", "TransferFailing",
                         "KV handoffs are failing: " + "; ".join(parts))
    if spec is not None and spec.kv_transfer.rdma is not None:
        fallen = [p for p in answered if p.health.transport is not None and not p.health.transport.rdma]
        if fallen:
            parts = []
            for p in fallen:
                t = p.health.transport
                why = t.reason or t.detected_by or "no reason given"
                parts.append(f"pod {p.pod} ({p.role}) uses {t.network or 'tcp'}: {why}")
            return condition(type_, "False", "RDMAFallback",
                             "kvTransfer.rdma is set but KV moves without RDMA: " + "; ".join(parts))
    speeds = kv_bandwidth.measured(answered)
    slow = kv_bandwidth.below_floor(speeds, spec.kv_transfer.min_bandwidth_gbps if spec is not None else None)
    if slow is not None:
        return condition(type_, "False", "BandwidthBelowFloor", slow)
    unreachable = [p for p in probes if p not in answered]
    if unreachable:
        parts = [f"pod {p.pod} ({p.role}): "
                 + (p.error or "answered without a KV transport (still loading, or --kv-backend none)")
                 for p in unreachable]
        return condition(type_, "Unknown", "Unreachable",
                         "no KV transfer health for " + "; ".join(parts))
    paths: dict[str, int] = {}
    for p in answered:
        network = p.health.transport.network if p.health.transport else "unknown"
        path = f"{p.health.backend} over {network}"
        paths[path] = paths.get(path, 0) + 1
    summary = "; ".join(f"{_plural(n, 'worker')} report{'s' if n == 1 else ''} {path}"
                        for path, n in sorted(paths.items()))
    if speeds:
        summary += "; " + kv_bandwidth.summary(speeds)
    return condition(type_, "True", "Healthy", summary)


def stamp(
    new: list[dict[str, str]], old: list[dict[str, Any]] | None, now: str, generation: int | None
) -> list[dict[str, Any]]:
    """Adds lastTransitionTime (kept from the old condition when its status is unchanged)."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for cond in new:
        prev = previous.get(cond["type"])
        if prev and prev.get("status") == cond["status"] and prev.get("lastTransitionTime"):
            ltt = prev["lastTransitionTime"]
        else:
            ltt = now
        stamped: dict[str, Any] = dict(cond, lastTransitionTime=ltt)
        if generation is not None:
            stamped["observedGeneration"] = generation
        out.append(stamped)
    return out


def compute_status(
    spec: InferenceServiceSpec | None,
    obs: Observation,
    old_status: dict | None,
    now: str,
    observed_generation: int | None,
    endpoint: str | None,
    kv_compat: str | None,
    scaling: Scaling | None = None,
    model: tuple[dict[str, Any] | None, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The whole status object to write; equal to old_status when nothing changed.

    spec is None when the operator cannot read it (obs.spec_error says why); endpoint and
    kv_compat (the pods' tandem.dev/kv-compat) None leave those fields out; scaling is None without spec.autoscaling;
    model is (status.model, the ModelReady condition) when known.
    """
    old_status = old_status or {}
    desired = desired_replicas(spec, obs, scaling)
    model_status, model_condition = model if model is not None else (None, None)
    conditions = stamp(compute_conditions(spec, obs, scaling, model_condition), old_status.get("conditions"),
                       now, observed_generation)
    status: dict[str, Any] = {"conditions": conditions}
    if observed_generation is not None:
        status["observedGeneration"] = observed_generation
    for role in COMPONENTS:
        ro = obs.roles.get(role, RoleObservation())
        status[role] = {
            "replicas": desired[role],
            "readyReplicas": ro.ready,
            "summary": f"{ro.ready}/{desired[role]}",
        }
        if ro.exists:
            status[role]["currentReplicas"] = ro.replicas
        sr = scaling.roles.get(role) if scaling is not None else None
        if sr is not None:
            status[role] |= {"mode": sr.mode, "reason": sr.reason, "message": sr.message}
            if sr.last_scale_time:
                status[role]["lastScaleTime"] = sr.last_scale_time
    if obs.router_service and endpoint is not None:
        status["endpoint"] = endpoint
    if kv_compat is not None:
        status["kvCompat"] = kv_compat
    if model_status is not None:
        status["model"] = model_status
    return status


def same_status(a: dict | None, b: dict | None) -> bool:
    """True when writing b over a would change nothing a reader cares about."""
    return (a or {}) == (b or {})
