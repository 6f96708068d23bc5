"""Status is computed from observed children: reasons for every way a role is not ready."""

from __future__ import annotations

from tandem.operator.spec import InferenceServiceSpec
from tandem.operator.status import Observation, RoleObservation, compute_status

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
EP = "http://x-router.ns.svc.cluster.local:8000"


def _spec(prefill=1, decode=1, router=1):
    return InferenceServiceSpec.from_dict({
        "model": {"path": "/m"},
        "prefill": {"replicas": prefill}, "decode": {"replicas": decode}, "router": {"replicas": router},
    })


def _ready_obs():
    return Observation(
        roles={r: RoleObservation(exists=True, replicas=1, ready=1) for r in ("prefill", "decode", "router")},
        router_service=True,
    )


def _cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def _unschedulable_pod(msg):
    return {"metadata": {"name": "x-prefill-abc"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": msg}]}}


def test_all_ready():
    st = compute_status(_spec(), _ready_obs(), None, T0, 3, EP, "g1")
    assert _cond(st, "Ready")["status"] == "True"
    assert _cond(st, "Ready")["reason"] == "AllComponentsReady"
    for t in ("PrefillReady", "DecodeReady", "RouterReady"):
        assert _cond(st, t)["status"] == "True" and _cond(st, t)["observedGeneration"] == 3
    assert _cond(st, "KVTransferReady")["status"] == "Unknown"
    assert st["endpoint"] == EP and st["observedGeneration"] == 3
    assert st["prefill"] == {"replicas": 1, "currentReplicas": 1, "readyReplicas": 1, "summary": "1/1"}
    assert not any(c["type"] == "Autoscaling" for c in st["conditions"]), "only with spec.autoscaling"


def test_unschedulable_pod_surfaces_with_the_scheduler_message():
    obs = _ready_obs()
    msg = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    obs.roles["prefill"] = RoleObservation(exists=True, replicas=1, ready=0, pods=[_unschedulable_pod(msg)])
    st = compute_status(_spec(), obs, None, T0, 1, EP, "g")
    c = _cond(st, "PrefillReady")
    assert (c["status"], c["reason"]) == ("False", "Unschedulable")
    assert msg in c["message"]
    assert _cond(st, "Ready")["reason"] == "Unschedulable"
    assert st["prefill"]["summary"] == "0/1"


def test_missing_deployment_and_scaled_to_zero():
    obs = _ready_obs()
    del obs.roles["decode"]
    st = compute_status(_spec(router=0), obs, None, T0, 1, EP, "g")
    assert _cond(st, "DecodeReady")["reason"] == "DeploymentMissing"
    assert _cond(st, "RouterReady")["reason"] == "ScaledToZero"
    assert _cond(st, "Ready")["reason"] == "DeploymentMissing"
    assert "decode" in _cond(st, "Ready")["message"] and "router" in _cond(st, "Ready")["message"]


def test_prefill_at_zero_still_serves():
    """Prefill may be scaled to 0 (by hand or by the autoscaler): decode prefills, the service is Ready."""
    obs = _ready_obs()
    obs.roles["prefill"] = RoleObservation(exists=True, replicas=0, ready=0)
    st = compute_status(_spec(prefill=0), obs, None, T0, 1, EP, "g")
    assert (_cond(st, "PrefillReady")["status"], _cond(st, "PrefillReady")["reason"]) == ("True", "ScaledToZero")
    assert _cond(st, "Ready")["status"] == "True"


def test_ready_reason_is_the_most_actionable_one():
    obs = _ready_obs()
    obs.roles["router"] = RoleObservation(exists=True, replicas=1, ready=0)  # starting
    obs.roles["prefill"] = RoleObservation(exists=True, replicas=1, ready=0, pods=[_unschedulable_pod("no GPU")])
    st = compute_status(_spec(), obs, None, T0, 1, EP, "g")
    assert _cond(st, "Ready")["reason"] == "Unschedulable"
    assert _cond(st, "RouterReady")["reason"] == "PodsNotReady"


def test_image_pull_failure_is_the_reason():
    obs = _ready_obs()
    pod = {"metadata": {"name": "p"}, "status": {"containerStatuses": [
        {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]}}
    obs.roles["decode"] = RoleObservation(exists=True, replicas=1, ready=0, pods=[pod])
    st = compute_status(_spec(), obs, None, T0, 1, EP, "g")
    assert _cond(st, "DecodeReady")["reason"] == "ImagePullBackOff"


def test_partially_ready_role_is_true_with_the_count():
    obs = _ready_obs()
    obs.roles["decode"] = RoleObservation(exists=True, replicas=3, ready=1)
    st = compute_status(_spec(decode=3), obs, None, T0, 1, EP, "g")
    c = _cond(st, "DecodeReady")
    assert (c["status"], c["reason"]) == ("True", "MinimumReplicasReady")
    assert st["decode"]["summary"] == "1/3"


def test_apply_failure_makes_ready_false():
    obs = _ready_obs()
    obs.apply_error = "applying Deployment/x-prefill: bad affinity"
    st = compute_status(_spec(), obs, None, T0, 1, EP, "g")
    assert _cond(st, "Ready")["reason"] == "ApplyFailed"
    assert "bad affinity" in _cond(st, "Ready")["message"]


def test_last_transition_time_changes_only_with_the_status():
    first = compute_status(_spec(), _ready_obs(), None, T0, 1, EP, "g")
    again = compute_status(_spec(), _ready_obs(), first, T1, 1, EP, "g")
    assert again == first, "nothing changed, nothing to write"
    obs = _ready_obs()
    obs.roles["router"] = RoleObservation(exists=True, replicas=1, ready=0)
    changed = compute_status(_spec(), obs, first, T1, 1, EP, "g")
    assert _cond(changed, "RouterReady")["lastTransitionTime"] == T1
    assert _cond(changed, "PrefillReady")["lastTransitionTime"] == T0


def test_no_endpoint_without_the_router_service():
    obs = _ready_obs()
    obs.router_service = False
    assert "endpoint" not in compute_status(_spec(), obs, None, T0, 1, EP, "g")


def test_an_unreadable_spec_is_ready_false_invalid_spec_judged_against_what_runs():
    """The CRD in the cluster may be older than the operator: the spec it let through is
    reported, not crashed on; the roles are judged against the Deployments as they run."""
    obs = _ready_obs()
    obs.roles["decode"] = RoleObservation(exists=True, replicas=3, ready=1)
    obs.spec_error = "spec.prefill.replicas: must be at most 1000, got 5000"
    old = compute_status(_spec(), _ready_obs(), None, T0, 1, EP, "g")
    st = compute_status(None, obs, old, T1, 1, None, None)
    ready = _cond(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"] == obs.spec_error and ready["lastTransitionTime"] == T1
    assert _cond(st, "DecodeReady")["message"] == "1/3 decode pods ready"
    assert st["decode"] == {"replicas": 3, "currentReplicas": 3, "readyReplicas": 1, "summary": "1/3"}
    assert "endpoint" not in st and "kvCompat" not in st
    assert _cond(st, "KVTransferReady")["reason"] == "NotProbed"
