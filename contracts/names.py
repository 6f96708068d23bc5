"""Names the operator, the router and the workers must agree on: the API group, labels,
annotations, worker roles, KV backends and ports; and how a pod is judged ready and whose it is."""

from __future__ import annotations

import enum
from typing import Any

GROUP = "tandem.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
API_VERSION = f"{GROUP}/{VERSION}"

# Labels every child carries; tandem.dev/service + tandem.dev/role select a role's pods.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = "tandem.dev/service"
LABEL_ROLE = "tandem.dev/role"
LABEL_KV_COMPAT = "tandem.dev/kv-compat"
ANNOTATION_CONFIG_HASH = "tandem.dev/config-hash"
MANAGED_BY = "tandem-operator"
# A worker whose tensor-parallel group spans nodes is a LeaderWorkerSet group: its leader pod runs
# rank 0 (HTTP, scheduler, sampling) and gets traffic; follower pods run the other ranks, get none.
LABEL_GROUP_MEMBER = "tandem.dev/group-member"

# Ports inside the pods (the router Service's port comes from the spec).
WORKER_PORT = 8000
ROUTER_PORT = 8000
WORKER_PORT_NAME = "http"
# The tcp KV backend's port on prefill workers: fixed, so the pod spec declares it.
KV_PORT = 5601
KV_PORT_NAME = "kv"
# Where the ranks of a group that spans nodes meet: a port on the leader pod (torch.distributed's
# store), reached as $LWS_LEADER_ADDRESS:RENDEZVOUS_PORT (`tandem worker --leader-address HOST:PORT`).
RENDEZVOUS_PORT = 29500
RENDEZVOUS_PORT_NAME = "dist"
# What LeaderWorkerSet sets in a group's pods, and the worker's group flags default from.
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"  # the leader pod's stable address (no port)
LWS_GROUP_SIZE_ENV = "LWS_GROUP_SIZE"  # pods in the group
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"  # this pod's index in the group (the leader's is 0)


class Role(enum.StrEnum):
    """A worker's job. The router is a component, not a worker role."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class GroupMember(enum.StrEnum):
    """A pod's place in a group that spans nodes (label LABEL_GROUP_MEMBER)."""

    LEADER = "leader"
    FOLLOWER = "follower"


def serves_requests(pod: dict[str, Any]) -> bool:
    """Whether a worker pod takes requests: every pod but a group's followers (they run ranks > 0)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_GROUP_MEMBER) != GroupMember.FOLLOWER


class KVBackend(enum.StrEnum):
    """How KV blocks move between workers (tandem.worker.kv.registry maps each to its module)."""

    NIXL = "nixl"
    TCP = "tcp"
    MEMORY = "memory"  # one process: engine tests only
    NONE = "none"  # a colocated worker that hands nothing off


def pod_ready(pod: dict[str, Any]) -> bool:
    """A pod (as a JSON dict) may get traffic: Ready, Running, with an IP and not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return (
        not meta.get("deletionTimestamp")
        and bool(status.get("podIP"))
        and status.get("phase", "Running") == "Running"
        and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    )


def pod_port(pod: dict[str, Any], default: int = WORKER_PORT, name: str = WORKER_PORT_NAME) -> int:
    """The container port called `name` (what the operator gives workers), else `default`."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def pod_url(pod: dict[str, Any], default_port: int = WORKER_PORT) -> str | None:
    """http://<pod IP>:<http port>, or None while the pod has no IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{pod_port(pod, default_port)}"


def controller_ref(obj: dict[str, Any], kind: str, group: str) -> dict[str, Any] | None:
    """The object's controller ownerReference if it is a `kind` of API group `group`, else None.

    Labels prove nothing (anyone who can create a pod can copy them): the operator and the router
    trust a pod only through this chain, pod -> ReplicaSet -> Deployment -> InferenceService."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            api_group = str(ref.get("apiVersion", "")).rpartition("/")[0]
            return ref if ref.get("kind") == kind and api_group == group else None
    return None
