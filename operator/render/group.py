"""A worker role whose tensor-parallel group spans nodes: one LeaderWorkerSet. Pure.

Each replica is a group of `parallelism.nodes` pods (sigs.k8s.io/lws): the leader pod runs rank 0
(the HTTP API, scheduler, sampling, KV bookkeeping) and gets traffic; the follower pods run the
other ranks. The LWS controller creates a group's pods together, recreates the whole group when
any of its pods restarts or is deleted (restartPolicy RecreateGroupOnPodRestart), counts a group
ready only when every pod is, and scales by whole groups. Its webhook gives every pod
LWS_LEADER_ADDRESS (the leader's stable DNS name), LWS_GROUP_SIZE and LWS_WORKER_INDEX, from
which `tandem worker` finds its ranks and meets the leader at RENDEZVOUS_PORT.

Placement: the pods of a group go to distinct nodes of the role's pool (one group spans `nodes`
nodes), and with `parallelism.topologyKey` to nodes that share that label's value (a rack, an
NVLink domain); both by pod (anti-)affinity on LWS's per-group label.
"""

from __future__ import annotations

import copy
from typing import Any

from tandem.contracts.names import (
    ANNOTATION_CONFIG_HASH,
    LABEL_GROUP_MEMBER,
    LABEL_KV_COMPAT,
    LABEL_ROLE,
    RENDEZVOUS_PORT,
    RENDEZVOUS_PORT_NAME,
    GroupMember,
)
from tandem.operator.config import OperatorConfig
from tandem.operator.render.identity import kv_compat_hash
from tandem.operator.render.objects import Manifest, common_labels, metadata, names
from tandem.operator.render.runtimes.registry import role_renderer
from tandem.operator.spec import InferenceServiceSpec, Parallelism

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
# Labels the LWS controller puts on every pod: its set, and a hash unique to one group.
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
HOSTNAME = "kubernetes.io/hostname"


def worker_group(meta: dict, spec: InferenceServiceSpec, role: str, config: OperatorConfig,
                 config_hash: str, replicas: int | None, pod_spec: dict[str, Any],
                 runtime: str | None = None) -> Manifest:
    """The role's LeaderWorkerSet: `replicas` groups (None leaves the field to an autoscaler); what
    a leader and a follower run differently is the runtime's (runtimes/)."""
    par = spec.role(role).parallelism
    name = names(meta["name"])[role]
    labels = common_labels(meta["name"], role) | {LABEL_ROLE: role, LABEL_KV_COMPAT: kv_compat_hash(spec, config)}
    group_pod, renderer = group_pod_spec(pod_spec, name, par), role_renderer(runtime or spec.runtime.name)

    def template(member: GroupMember) -> dict[str, Any]:
        return {"metadata": {"labels": labels | {LABEL_GROUP_MEMBER: member.value},
                             "annotations": {ANNOTATION_CONFIG_HASH: config_hash}},
                "spec": renderer.group_member(copy.deepcopy(group_pod), member, par)}

    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": metadata(meta, name, role, {LABEL_ROLE: role}),
        "spec": {
            **({} if replicas is None else {"replicas": replicas}),
            # Followers start with their leader, not after it is ready: it is ready only once they joined.
            "startupPolicy": "LeaderCreated",
            # As the Deployments: a new group comes up before an old one goes (room for one more group).
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}},
            "leaderWorkerTemplate": {
                "size": par.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template(GroupMember.LEADER),
                "workerTemplate": template(GroupMember.FOLLOWER),
            },
        },
    }


def group_pod_spec(pod_spec: dict[str, Any], lws_name: str, par: Parallelism) -> dict[str, Any]:
    """A worker pod spec made a group member's: the rendezvous port, and placement by group."""
    pod = copy.deepcopy(pod_spec)
    # A Deployment's spread (by pod-template-hash) means nothing here; the group terms replace it.
    pod.pop("topologySpreadConstraints", None)
    container = pod["containers"][0]
    container["ports"] = [*container["ports"], {"name": RENDEZVOUS_PORT_NAME, "containerPort": RENDEZVOUS_PORT,
                                                "protocol": "TCP"}]
    pod["affinity"] = group_affinity(pod.get("affinity"), lws_name, par)
    return pod


def _same_group(lws_name: str, topology_key: str) -> dict[str, Any]:
    """A pod affinity term matching the pods of the incoming pod's own group (LWS's group-key)."""
    return {"labelSelector": {"matchLabels": {LWS_NAME_LABEL: lws_name}},
            "matchLabelKeys": [LWS_GROUP_KEY_LABEL], "topologyKey": topology_key}


def group_affinity(user: dict[str, Any] | None, lws_name: str, par: Parallelism) -> dict[str, Any]:
    """The user's affinity plus: a group's pods on distinct nodes, and in one topology domain."""
    affinity = copy.deepcopy(user or {})
    anti = affinity.setdefault("podAntiAffinity", {})
    anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(_same_group(lws_name, HOSTNAME))
    if par.topology_key:
        together = affinity.setdefault("podAffinity", {})
        together.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            _same_group(lws_name, par.topology_key))
    return affinity
