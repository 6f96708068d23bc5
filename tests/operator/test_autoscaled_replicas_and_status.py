"""Autoscaling between planner and renderer, pure: the desired replicas kept in status are what the
Deployments get, External mode leaves the field out, and status explains each autoscaled role."""

from __future__ import annotations

import yaml
from tandem.operator.autoscaling.status import kept_replicas, render_replicas, scaling_status
from tandem.operator.config import OperatorConfig
from tandem.operator.render import render
from tandem.operator.status import Observation, RoleObservation, compute_status
from tandem.planning.autoscaling.planner import Decision, Reason, RoleDecision

CONFIG = OperatorConfig()
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _spec(typed, autoscaling: dict | None, decode: int = 2, prefill: int = 1):
    raw = {"model": {"path": "/m"}, "prefill": {"replicas": prefill}, "decode": {"replicas": decode}}
    return typed(raw | ({"autoscaling": autoscaling} if autoscaling else {}))


def _deployment(manifests: list[dict], role: str) -> dict:
    return next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == f"llama-{role}")


def _obs(**replicas: int) -> Observation:
    roles = {r: RoleObservation(exists=True, replicas=n, ready=n) for r, n in replicas.items()}
    return Observation(roles=roles, router_service=True)


def _cond(status: dict, type_: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_without_autoscaling_the_spec_decides(typed, meta):
    spec = _spec(typed, None, decode=3)
    assert render_replicas(spec, {"decode": {"replicas": 7}}) == {"prefill": 1, "decode": 3}
    assert _deployment(render(meta, spec, CONFIG), "decode")["spec"]["replicas"] == 3


def test_the_planners_count_in_status_is_what_the_deployment_gets_within_limits(typed, meta):
    spec = _spec(typed, {"decode": {"minReplicas": 2, "maxReplicas": 6}}, decode=1)
    assert kept_replicas(spec, None, "decode") == 2, "at first spec.decode.replicas, raised to minReplicas"
    assert kept_replicas(spec, {"decode": {"replicas": 5}}, "decode") == 5
    assert kept_replicas(spec, {"decode": {"replicas": 40}}, "decode") == 6, "a lowered maxReplicas holds"
    counts = render_replicas(spec, {"decode": {"replicas": 5}, "prefill": {"replicas": 9}})
    assert counts == {"prefill": 1, "decode": 5}, "prefill is not autoscaled: its spec holds"
    manifests = render(meta, spec, CONFIG, counts)
    assert _deployment(manifests, "decode")["spec"]["replicas"] == 5
    assert _deployment(manifests, "prefill")["spec"]["replicas"] == 1


def test_external_mode_renders_no_replicas(typed, meta):
    spec = _spec(typed, {"decode": {"mode": "External"}})
    counts = render_replicas(spec, {"decode": {"replicas": 4}})
    assert counts == {"prefill": 1, "decode": None}
    manifests = render(meta, spec, CONFIG, counts)
    assert "replicas" not in _deployment(manifests, "decode")["spec"]
    assert _deployment(manifests, "prefill")["spec"]["replicas"] == 1


def test_status_explains_a_decision_and_keeps_it_between_decisions(typed):
    spec = _spec(typed, {"decode": {"maxReplicas": 4}}, decode=1)
    decision = Decision(10.0, {"decode": RoleDecision("decode", 1, 2, Reason.QUEUE_BUILDING,
                                                      "1 -> 2: 4 sequences wait for a decode slot, 2 run")},
                        {"type": "Autoscaling", "status": "True", "reason": "Active",
                         "message": "decode 1->2 (QueueBuilding)"})
    obs = _obs(prefill=1, decode=1, router=1)
    first = compute_status(spec, obs, None, T0, 1, None, None, scaling_status(spec, obs, None, T0, decision))
    assert first["decode"] == {"replicas": 2, "currentReplicas": 1, "readyReplicas": 1, "summary": "1/2",
                               "mode": "Operator", "reason": "QueueBuilding",
                               "message": "1 -> 2: 4 sequences wait for a decode slot, 2 run",
                               "lastScaleTime": T0}
    assert "mode" not in first["prefill"], "prefill is not autoscaled"
    assert _cond(first, "Autoscaling")["reason"] == "Active"
    assert _cond(first, "DecodeReady")["message"] == "1/2 decode pods ready"
    # A reconcile between two decisions (the Deployment has caught up) changes none of it.
    obs2 = _obs(prefill=1, decode=2, router=1)
    again = compute_status(spec, obs2, first, T1, 1, None, None, scaling_status(spec, obs2, first, T1))
    assert again["decode"] | {"currentReplicas": 1, "readyReplicas": 1, "summary": "1/2"} == first["decode"]
    assert _cond(again, "Autoscaling") == _cond(first, "Autoscaling")


def test_before_the_first_decision_status_says_it_is_collecting(typed):
    spec = _spec(typed, {"decode": {"maxReplicas": 4}}, decode=3)
    obs = _obs(prefill=1, decode=3, router=1)
    status = compute_status(spec, obs, None, T0, 1, None, None, scaling_status(spec, obs, None, T0))
    assert (status["decode"]["replicas"], status["decode"]["reason"]) == (3, "CollectingMetrics")
    assert (_cond(status, "Autoscaling")["status"], _cond(status, "Autoscaling")["reason"]) == (
        "Unknown", "CollectingMetrics")


def test_external_mode_reports_what_the_deployment_runs(typed):
    spec = _spec(typed, {"decode": {"mode": "External"}}, decode=1)
    obs = _obs(prefill=1, decode=5, router=1)
    status = compute_status(spec, obs, None, T0, 1, None, None, scaling_status(spec, obs, None, T0))
    assert status["decode"]["replicas"] == 5 and status["decode"]["mode"] == "External"
    assert status["decode"]["reason"] == "External" and "HPA or KEDA" in status["decode"]["message"]
    c = _cond(status, "Autoscaling")
    assert (c["status"], c["reason"]) == ("False", "External")


def test_a_worker_pods_drain_and_kv_lease_fit_in_its_grace_period(typed, meta):
    """A prefill pod (its prompts' KV) or a decode pod (its migrated sequences' KV) being removed
    stays until every KV block it leased is pulled or expired: the lease never outlives the drain,
    and the drain ends before the kubelet's SIGKILL."""
    for grace in (15, 30, 120, 600):
        spec = typed({"model": {"path": "/m"}, "prefill": {"terminationGracePeriodSeconds": grace},
                      "decode": {"terminationGracePeriodSeconds": grace}})
        manifests = render(meta, spec, CONFIG)
        cm = next(m for m in manifests if m["kind"] == "ConfigMap")
        prefill = yaml.safe_load(cm["data"]["prefill.yaml"])
        decode = yaml.safe_load(cm["data"]["decode.yaml"])
        pod = _deployment(manifests, "prefill")["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace
        assert prefill["kv_lease_s"] <= prefill["drain_s"] < grace, grace
        assert prefill["kv_lease_s"] >= 10, "at least one KV pull (the worker's 10 s pull timeout)"
        assert decode["kv_lease_s"] <= decode["drain_s"] < grace, grace
    assert prefill["kv_lease_s"] == 30, "a long grace keeps the worker's default lease"


def test_a_planner_without_history_starts_from_the_current_count(typed):
    """After a restart (or for a newly autoscaled role) a scale-down waits a whole window; a
    scale-up with a 0 s window does not wait."""
    from tandem.operator.autoscaling.autoscaler import _seeded
    from tandem.planning.autoscaling.planner import PlannerState, _stabilize

    a = _spec(typed, {"prefill": {"mode": "External"}, "decode": {"maxReplicas": 8}}).autoscaling
    state = _seeded(None, a, {"prefill": 3, "decode": 4}, 100.0)
    assert set(state.history) == {"decode"}, "an External role is not planned"
    rs = a.decode
    down = (*state.history["decode"], (100.0, 1))
    assert _stabilize(down, 100.0, 4, rs) == 4, "the seeded count holds a scale-down"
    up = (*state.history["decode"], (100.0, 6))
    assert _stabilize(up, 100.0, 4, rs) == 6, "a scale-up goes at once"
    kept = PlannerState(history={"decode": ((50.0, 2),)})
    assert _seeded(kept, a, {"decode": 4}, 100.0) is kept, "known history is left as it is"
