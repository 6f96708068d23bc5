"""A user's own claim (`model.pvc`) judged against where the workers run. Pure.

A claim mounts where its access modes allow: ReadOnlyMany and ReadWriteMany on any number of nodes,
ReadWriteOnce on one node (any number of pods there), ReadWriteOncePod in one pod. A service always
runs more than one worker pod at some moment: a rollout starts each new pod before the old one stops
(maxSurge 1, maxUnavailable 0), and prefill and decode are pods of their own. So for ModelReady:

  no such claim                   False    ClaimNotFound    not blocking: the pods are applied, wait
                                                            (Pending) and start once the claim exists
  ReadWriteOncePod only           False    ClaimSinglePod   blocking: a second pod never starts, so
                                                            even a one-pod service stalls at its
                                                            first rollout
  ReadWriteOnce, a group that     False    ClaimSingleNode  blocking: a group's pods run on distinct
  spans nodes                                               nodes by construction
  ReadWriteOnce otherwise         Unknown  ClaimSingleNode  a warning, not a refusal: the pods may all
                                                            land on one node (a one-node cluster, a
                                                            PV with node affinity), and then it works
  ReadOnlyMany or ReadWriteMany   None: every pod can mount it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator.spec import WORKER_ROLES, InferenceServiceSpec

MANY_NODES = ("ReadOnlyMany", "ReadWriteMany")
UNBOUNDED = 10**6  # an external autoscaler's replicas: no maximum the operator knows


@dataclass(frozen=True)
class ClaimProblem:
    """What is wrong with the claim for this spec: the condition's status, reason and message, and
    whether nothing may be applied."""

    status: str
    reason: str
    message: str
    blocking: bool


def most_worker_pods(spec: InferenceServiceSpec) -> int:
    """The most prefill and decode pods the spec may run at once (UNBOUNDED under an external autoscaler)."""
    total = 0
    for role in WORKER_ROLES:
        worker = spec.role(role)
        scaling = spec.autoscaling.roles.get(role) if spec.autoscaling is not None else None
        if scaling is None:
            replicas = worker.replicas
        elif spec.autoscaling.external(role) or scaling.max_replicas is None:
            replicas = UNBOUNDED
        else:
            replicas = max(scaling.max_replicas, worker.replicas)
        total += replicas * worker.parallelism.nodes
    return total


def _spanning(spec: InferenceServiceSpec) -> list[str]:
    return [role for role in WORKER_ROLES if spec.role(role).parallelism.spans_nodes]


def judge_claim(claim: dict[str, Any] | None, spec: InferenceServiceSpec) -> ClaimProblem | None:
    """The problem with model.pvc's claim (as read from the API server, None when absent) for this
    spec, or None when every worker pod can mount it."""
    name = spec.model.pvc.claim_name if spec.model.pvc is not None else ""
    if claim is None:
        return ClaimProblem("False", "ClaimNotFound", (
            f"model.pvc.claimName {name!r}: no PersistentVolumeClaim of that name in this namespace; the "
            "worker pods wait (Pending) until it exists"), blocking=False)
    modes = list((claim.get("spec") or {}).get("accessModes") or [])
    if any(m in MANY_NODES for m in modes):
        return None
    pods = most_worker_pods(spec)
    count = "any number of (an external autoscaler decides)" if pods >= UNBOUNDED else f"up to {pods}"
    said = f"claim {name} has accessModes {modes or '[]'}"
    instead = ("use a ReadOnlyMany or ReadWriteMany claim (NFS, CephFS, a cloud file store, or a ReadOnlyMany "
               "PersistentVolume of the same disk), or model.hub with model.cache.pvc")
    if "ReadWriteOnce" not in modes:  # ReadWriteOncePod only
        return ClaimProblem("False", "ClaimSinglePod", (
            f"{said}: it mounts in one pod only, and this service runs {count} worker pods, one more "
            f"during a rollout (the new pod starts before the old one stops): {instead}"), blocking=True)
    spanning = _spanning(spec)
    if spanning:
        return ClaimProblem("False", "ClaimSingleNode", (
            f"{said}: it mounts on one node only, and a {' and a '.join(spanning)} group spans nodes "
            f"(parallelism.nodes > 1: its pods run on distinct nodes): {instead}"), blocking=True)
    return ClaimProblem("Unknown", "ClaimSingleNode", (
        f"{said}: it mounts on one node only, and this service runs {count} worker pods, one more during a "
        "rollout; a pod the scheduler places on another node stays ContainerCreating (Multi-Attach error). "
        f"Fine while they all run on one node; otherwise {instead}"), blocking=False)
