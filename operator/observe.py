"""What runs for one InferenceService: its Deployments, their pods and the router Service.

Selected by label, then kept only if the owner chain says they are the service's: a Deployment
controlled by the InferenceService (its uid), a pod controlled by a ReplicaSet that such a
Deployment controls. Labels prove nothing: anyone who may create a pod in the namespace can copy
them, and the operator probes, scrapes and counts the pods it observes. ReplicaSet ownership is
read once per ReplicaSet (`replicasets: get`) and kept by the caller (`owners`).
"""

from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.contracts.names import GROUP, KIND, LABEL_ROLE, LABEL_SERVICE, controller_ref
from tandem.operator.apply import request
from tandem.operator.status import Observation, RoleObservation

# ReplicaSet uid -> the uid of the Deployment that controls it ("" when none does).
Owners = dict[str, str]


def _list(api: client.ApiClient, path: str, selector: str) -> list[dict]:
    return request(api, "GET", path, query=[("labelSelector", selector)]).get("items") or []


def _controlled_by(obj: dict[str, Any], kind: str, group: str, uids: set[str]) -> bool:
    ref = controller_ref(obj, kind, group)
    return ref is not None and ref.get("uid") in uids


def owned_pods(pods: list[dict], deployment_uids: set[str], owners: Owners) -> list[dict]:
    """The pods a ReplicaSet of one of those Deployments controls, not being deleted. Pure: `owners`
    must know every ReplicaSet the pods name (missing_replica_sets says which to read)."""
    out = []
    for pod in pods:
        ref = controller_ref(pod, "ReplicaSet", "apps")
        if ref is not None and owners.get(ref.get("uid", "")) in deployment_uids \
                and not pod["metadata"].get("deletionTimestamp"):
            out.append(pod)
    return out


def missing_replica_sets(pods: list[dict], owners: Owners) -> dict[str, str]:
    """ReplicaSet uid -> name, for the ReplicaSets the pods name that `owners` does not know yet."""
    out = {}
    for pod in pods:
        ref = controller_ref(pod, "ReplicaSet", "apps")
        if ref is not None and ref.get("uid") and ref["uid"] not in owners:
            out[ref["uid"]] = ref.get("name", "")
    return out


def _learn(api: client.ApiClient, namespace: str, pods: list[dict], owners: Owners) -> None:
    """Reads the ReplicaSets not known yet; forgets those no pod names any more."""
    named = {ref["uid"] for p in pods if (ref := controller_ref(p, "ReplicaSet", "apps")) and ref.get("uid")}
    for uid in [u for u in owners if u not in named]:
        del owners[uid]
    for uid, name in missing_replica_sets(pods, owners).items():
        try:
            rs = request(api, "GET", f"/apis/apps/v1/namespaces/{namespace}/replicasets/{name}")
        except ApiException as e:
            if e.status != 404:
                raise
            continue  # gone: its pods go too; asked again if a pod still names it
        same = rs["metadata"].get("uid") == uid
        ref = controller_ref(rs, "Deployment", "apps")
        owners[uid] = ref.get("uid", "") if same and ref is not None else ""


def observe(api: client.ApiClient, namespace: str, name: str, uid: str | None,
            owners: Owners | None = None) -> Observation:
    """The service's Deployments and pods (by label, then by owner chain) and its router Service."""
    owners = {} if owners is None else owners
    selector = f"{LABEL_SERVICE}={name}"
    deployments = [d for d in _list(api, f"/apis/apps/v1/namespaces/{namespace}/deployments", selector)
                   if _controlled_by(d, KIND, GROUP, {uid or ""})]
    pods = _list(api, f"/api/v1/namespaces/{namespace}/pods", selector)
    _learn(api, namespace, pods, owners)
    obs = Observation()
    for d in deployments:
        role = (d["metadata"].get("labels") or {}).get(LABEL_ROLE)
        if role is None:
            continue
        role_pods = owned_pods(pods, {d["metadata"]["uid"]}, owners)
        obs.roles[role] = RoleObservation(
            exists=True,
            replicas=d["spec"].get("replicas") or 0,
            ready=(d.get("status") or {}).get("readyReplicas") or 0,
            pods=role_pods,
        )
    services = _list(api, f"/api/v1/namespaces/{namespace}/services", f"{selector},{LABEL_ROLE}=router")
    obs.router_service = any(s["metadata"]["name"] == f"{name}-router" and _controlled_by(s, KIND, GROUP, {uid or ""})
                             for s in services)
    return obs
