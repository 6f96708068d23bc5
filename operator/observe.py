"""What runs for one InferenceService: its workloads (a Deployment per role, or a LeaderWorkerSet for
a role whose groups span nodes), their pods and the router Service.

Selected by label, then kept only if the owner chain says they are the service's: a workload the
InferenceService (its uid) controls, a pod whose controllers lead to such a workload (a ReplicaSet to
a Deployment; a StatefulSet to a LeaderWorkerSet, a group's followers through their leader pod).
Labels prove nothing: anyone who may create a pod in the namespace can copy them, and the operator
probes, scrapes and counts the pods it observes. Each ReplicaSet or StatefulSet is read once (`get`)
and kept by the caller (`owners`) while a pod still names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.contracts.names import GROUP, KIND, LABEL_ROLE, LABEL_SERVICE, controller_ref
from tandem.operator.apply import request
from tandem.operator.status import Observation, role_observation

LWS = "leaderworkerset.x-k8s.io/v1"
# A controller's uid -> its own controller reference (None: it has none, or it is gone).
Owners = dict[str, "dict[str, Any] | None"]
Fetch = Callable[[str, str], "dict[str, Any] | None"]  # (kind, name) -> the object, None when gone
CHAIN_HOPS = 4  # follower -> worker StatefulSet -> leader pod -> leader StatefulSet -> LeaderWorkerSet


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)


def trusted(pod: dict[str, Any], workloads: set[str], pods_by_uid: dict[str, dict], owners: Owners,
            fetch: Fetch) -> bool:
    """Whether the pod's controllers lead to one of the `workloads` (uids) within CHAIN_HOPS. A
    ReplicaSet or StatefulSet not in `owners` is read with `fetch` (by name, checked by uid)."""
    ref = _controller(pod)
    for _ in range(CHAIN_HOPS):
        if ref is None:
            return False
        uid = ref.get("uid", "")
        if uid in workloads:
            return True
        if ref.get("kind") == "Pod" and uid in pods_by_uid:
            ref = _controller(pods_by_uid[uid])
        elif ref.get("kind") in ("ReplicaSet", "StatefulSet") and str(ref.get("apiVersion")).startswith("apps/"):
            if uid not in owners:
                found = fetch(ref["kind"], ref.get("name", ""))
                owners[uid] = _controller(found) if found and found["metadata"].get("uid") == uid else None
            ref = owners[uid]
        else:
            return False
    return False


def _list(api: client.ApiClient, path: str, selector: str, absent_ok: bool = False) -> list[dict]:
    try:
        return request(api, "GET", path, query=[("labelSelector", selector)]).get("items") or []
    except ApiException as e:
        if absent_ok and e.status == 404:  # a kind the cluster does not serve (no LeaderWorkerSet CRD)
            return []
        raise


def _fetcher(api: client.ApiClient, namespace: str) -> Fetch:
    def fetch(kind: str, name: str) -> dict[str, Any] | None:
        plural = {"ReplicaSet": "replicasets", "StatefulSet": "statefulsets"}[kind]
        try:
            return request(api, "GET", f"/apis/apps/v1/namespaces/{namespace}/{plural}/{name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    return fetch


def observe(api: client.ApiClient, namespace: str, name: str, uid: str | None,
            owners: Owners | None = None, groups: bool = True) -> Observation:
    """The service's workloads and pods (by label, then by owner chain) and its router Service;
    LeaderWorkerSets only with `groups` (a role of the spec spans nodes, or the spec is unreadable).

    A role run as a LeaderWorkerSet counts groups: its replicas are groups, and a group is ready when
    every one of its pods is (status.role_observation)."""
    owners = {} if owners is None else owners
    selector = f"{LABEL_SERVICE}={name}"
    ours = {uid or ""}
    # A list's items of a built-in kind carry no kind of their own.
    workloads = [{"apiVersion": "apps/v1", "kind": "Deployment", **d}
                 for d in _list(api, f"/apis/apps/v1/namespaces/{namespace}/deployments", selector)]
    if groups:
        workloads += _list(api, f"/apis/{LWS}/namespaces/{namespace}/leaderworkersets", selector, absent_ok=True)
    workloads = [w for w in workloads if (controller_ref(w, KIND, GROUP) or {}).get("uid") in ours]
    pods = [p for p in _list(api, f"/api/v1/namespaces/{namespace}/pods", selector)
            if not p["metadata"].get("deletionTimestamp")]
    by_uid = {p["metadata"]["uid"]: p for p in pods}
    fetch = _fetcher(api, namespace)
    obs = Observation()
    for workload in workloads:
        role = (workload["metadata"].get("labels") or {}).get(LABEL_ROLE)
        if role is None or workload["metadata"].get("deletionTimestamp"):  # e.g. pruned: kind switched
            continue
        obs.workloads[f"{workload['kind']}/{workload['metadata']['name']}"] = workload
        mine = {workload["metadata"]["uid"]}
        role_pods = [p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_ROLE) == role
                     and trusted(p, mine, by_uid, owners, fetch)]
        obs.roles[role] = role_observation(workload, role_pods)
    for key in [k for k in owners if not _named(k, pods, owners)]:
        del owners[key]  # nothing names it any more
    services = _list(api, f"/api/v1/namespaces/{namespace}/services", f"{selector},{LABEL_ROLE}=router")
    obs.router_service = any(s["metadata"]["name"] == f"{name}-router"
                             and (controller_ref(s, KIND, GROUP) or {}).get("uid") in ours for s in services)
    return obs


def _named(uid: str, pods: list[dict], owners: Owners) -> bool:
    """Whether a live pod, or a controller kept in `owners`, names `uid` as its controller."""
    return any((_controller(p) or {}).get("uid") == uid for p in pods) or any(
        (ref or {}).get("uid") == uid for ref in owners.values())


def observe_download(api: client.ApiClient, namespace: str, job: str) -> tuple[dict | None, list[dict]]:
    """A hub model's download Job (None when it does not exist yet) and, once an attempt has failed,
    the pods it controls (their termination messages say why; a pod that merely copies the Job's
    labels is not one of them)."""
    try:
        found = request(api, "GET", f"/apis/batch/v1/namespaces/{namespace}/jobs/{job}")
    except ApiException as e:
        if e.status == 404:
            return None, []
        raise
    status = found.get("status") or {}
    failing = any(c.get("type") in ("Failed", "FailureTarget") for c in status.get("conditions") or [])
    if not status.get("failed") and not failing:
        return found, []
    uid = found["metadata"]["uid"]
    pods = _list(api, f"/api/v1/namespaces/{namespace}/pods", f"batch.kubernetes.io/controller-uid={uid}")
    return found, [p for p in pods if (_controller(p) or {}).get("uid") == uid]
