"""What runs for one InferenceService, from what the watch has seen (tandem.operator.watch). Pure.

Its workloads (a Deployment per role, or a LeaderWorkerSet for a role whose groups span nodes), their
pods and the router Service are selected by label, then kept only if the owner chain says they are
the service's: a workload the InferenceService (its uid) controls, a pod whose controllers lead to
such a workload (a ReplicaSet to a Deployment; a StatefulSet to a LeaderWorkerSet, a group's
followers through their leader pod). Labels prove nothing: anyone who may create a pod in the
namespace can copy them, and the operator probes, scrapes and counts the pods it observes.

The owner chain's ReplicaSets come from the watch; a controller it has not seen (a group's
StatefulSets) is read once by the caller (`missing_owners`, then tandem.operator.api_client) and kept
in `owners` while a pod still names it.
"""

from __future__ import annotations

from typing import Any

from tandem.contracts.names import GROUP, KIND, LABEL_ROLE, controller_ref
from tandem.operator.status import Observation, role_observation
from tandem.operator.watch import Seen

# A controller's uid -> its own controller reference (None: it has none, or it is gone).
Owners = dict[str, "dict[str, Any] | None"]
CHAIN_HOPS = 4  # follower -> worker StatefulSet -> leader pod -> leader StatefulSet -> LeaderWorkerSet
CHAIN_KINDS = ("ReplicaSet", "StatefulSet")


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)


def _chain_ref(ref: dict[str, Any] | None) -> bool:
    return ref is not None and ref.get("kind") in CHAIN_KINDS and str(ref.get("apiVersion")).startswith("apps/")


def trusted(pod: dict[str, Any], workloads: set[str], pods_by_uid: dict[str, dict], owners: Owners) -> bool:
    """Whether the pod's controllers lead to one of the `workloads` (uids) within CHAIN_HOPS; a
    ReplicaSet or StatefulSet missing from `owners` breaks the chain."""
    ref = _controller(pod)
    for _ in range(CHAIN_HOPS):
        if ref is None:
            return False
        uid = ref.get("uid", "")
        if uid in workloads:
            return True
        if ref.get("kind") == "Pod" and uid in pods_by_uid:
            ref = _controller(pods_by_uid[uid])
        elif _chain_ref(ref):
            ref = owners.get(uid)
        else:
            return False
    return False


def live_pods(seen: Seen) -> list[dict[str, Any]]:
    return [p for p in seen.of("Pod") if not p["metadata"].get("deletionTimestamp")]


def learn_owners(seen: Seen, owners: Owners) -> None:
    """Keeps what the watched ReplicaSets say of their controllers, and forgets the controllers no
    live pod (or kept controller) names any more."""
    for rs in seen.of("ReplicaSet"):
        owners[rs["metadata"]["uid"]] = _controller(rs)
    pods = live_pods(seen)
    named = {(_controller(p) or {}).get("uid") for p in pods} | {(r or {}).get("uid") for r in owners.values()}
    for uid in [u for u in owners if u not in named]:
        del owners[uid]


def missing_owners(seen: Seen, owners: Owners) -> list[tuple[str, str, str]]:
    """(kind, name, uid) of each pod's ReplicaSet or StatefulSet that `owners` does not know: to read."""
    out = {}
    for pod in live_pods(seen):
        ref = _controller(pod)
        if _chain_ref(ref) and ref.get("uid") not in owners:
            out[ref["uid"]] = (ref["kind"], ref.get("name", ""), ref["uid"])
    return sorted(out.values())


def observe(seen: Seen, name: str, uid: str | None, owners: Owners, groups: bool = True) -> Observation:
    """The service's workloads and pods (by owner chain) and its router Service; LeaderWorkerSets only
    with `groups` (a role of the spec spans nodes, or the spec is unreadable).

    A role run as a LeaderWorkerSet counts groups: its replicas are groups, and a group is ready when
    every one of its pods is (status.role_observation)."""
    ours = {uid or ""}
    workloads = seen.of("Deployment", "LeaderWorkerSet") if groups else seen.of("Deployment")
    workloads = [w for w in workloads if (controller_ref(w, KIND, GROUP) or {}).get("uid") in ours]
    pods = live_pods(seen)
    by_uid = {p["metadata"]["uid"]: p for p in pods}
    obs = Observation()
    for workload in workloads:
        role = (workload["metadata"].get("labels") or {}).get(LABEL_ROLE)
        if role is None or workload["metadata"].get("deletionTimestamp"):  # e.g. pruned: kind switched
            continue
        obs.workloads[f"{workload['kind']}/{workload['metadata']['name']}"] = workload
        mine = {workload["metadata"]["uid"]}
        role_pods = [p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_ROLE) == role
                     and trusted(p, mine, by_uid, owners)]
        obs.roles[role] = role_observation(workload, role_pods)
    obs.router_service = any(s["metadata"]["name"] == f"{name}-router"
                             and (controller_ref(s, KIND, GROUP) or {}).get("uid") in ours
                             for s in seen.of("Service"))
    return obs


def download(seen: Seen, job: str) -> tuple[dict | None, list[dict]]:
    """A hub model's download Job (None when it does not exist yet) and, once an attempt has failed,
    the pods it controls (their termination messages say why; a pod that merely copies the Job's
    labels is not one of them)."""
    found = next((j for j in seen.of("Job") if j["metadata"]["name"] == job), None)
    if found is None:
        return None, []
    status = found.get("status") or {}
    failing = any(c.get("type") in ("Failed", "FailureTarget") for c in status.get("conditions") or [])
    if not status.get("failed") and not failing:
        return found, []
    uid = found["metadata"]["uid"]
    return found, [p for p in seen.of("Pod") if (_controller(p) or {}).get("uid") == uid]
