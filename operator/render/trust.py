"""The service's trust boundary: the internal secret its router and workers share, and the
NetworkPolicy that keeps every other pod off the workers' ports. Pure.

The Secret's value is random, so it is not rendered here: the operator creates it once
(`apply.ensure_internal_secret`, create-if-absent: it never reads Secrets; `ownership.secret_record`
says when an existing one may be used) and the pods take it from `secretKeyRef`; its uid on the pod
templates rolls them when it is created again. Workers require it on /internal/* and on the TCP KV port
(tandem.contracts.internal_auth).
"""

from __future__ import annotations

import secrets
from typing import Any

from tandem.contracts.gateway import PICKER, SIDECAR_PORT_NAME
from tandem.contracts.internal_auth import SECRET_ENV
from tandem.contracts.names import LABEL_ROLE, LABEL_SERVICE, RENDEZVOUS_PORT, WORKER_PORT_NAME
from tandem.contracts.runtimes import Runtime
from tandem.operator.config import OperatorConfig
from tandem.operator.render.group import LWS_NAME_LABEL
from tandem.operator.render.objects import Manifest, metadata, names
from tandem.operator.spec import ROUTER, WORKER_ROLES, InferenceServiceSpec

SECRET_KEY = "secret"
# Runtime vllm: the container port of a server's KV events publisher (ZMQ), which the router reads.
KV_EVENTS_PORT_NAME = "kv-events"
# On every pod template: the uid of the internal Secret its pods read. A Secret deleted and created
# again (a new value) changes it, and the pods roll onto the new value (issue 21.8).
ANNOTATION_SECRET_UID = "tandem.dev/internal-secret-uid"


def internal_secret_env(name: str) -> dict[str, Any]:
    """The env entry every router and worker container gets."""
    return {"name": SECRET_ENV,
            "valueFrom": {"secretKeyRef": {"name": names(name)["internal"], "key": SECRET_KEY}}}


def internal_secret(meta: dict) -> Manifest:
    """A fresh Secret for one service (random: call once, create if absent)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(meta, names(meta["name"])["internal"], "internal"),
        "stringData": {SECRET_KEY: secrets.token_urlsafe(32)},
    }


def with_secret_uid(uid: str | None, manifests: list[Manifest]) -> list[Manifest]:
    """Annotates every pod template among `manifests` with the internal Secret's uid (when known)."""
    for m in manifests if uid else ():
        template = (m.get("spec") or {}).get("template")
        if template is not None:
            template.setdefault("metadata", {}).setdefault("annotations", {})[ANNOTATION_SECRET_UID] = uid
    return manifests


# Every port but the rendezvous of a tensor-parallel group spanning nodes (TCP ranges, any UDP/SCTP).
_ALL_BUT_RENDEZVOUS = [{"protocol": "TCP", "port": 1, "endPort": RENDEZVOUS_PORT - 1},
                       {"protocol": "TCP", "port": RENDEZVOUS_PORT + 1, "endPort": 65535},
                       {"protocol": "UDP"}, {"protocol": "SCTP"}]


def _worker_rules(name: str, spec: InferenceServiceSpec, workers: dict[str, Any]) -> list[dict[str, Any]]:
    """The service's own workers on every port (KV moves between them, over the tcp backend's port
    or UCX's ephemeral ones); with groups spanning nodes, the rendezvous port only from the pods of
    the role's own LeaderWorkerSet (its groups: the store's values are sealed with the secret too)."""
    own = {"podSelector": {"matchLabels": {LABEL_SERVICE: name}, "matchExpressions": [workers]}}
    grouped = [r for r in WORKER_ROLES if spec.role(r).parallelism.spans_nodes]
    if not grouped:
        return [{"from": [own]}]
    rendezvous = [{"protocol": "TCP", "port": RENDEZVOUS_PORT}]
    return [{"from": [own], "ports": _ALL_BUT_RENDEZVOUS}] + [
        {"from": [{"podSelector": {"matchLabels": {LABEL_SERVICE: name, LWS_NAME_LABEL: names(name)[r]}}}],
         "ports": rendezvous} for r in grouped]


def _gateway_rules(own: dict[str, str], spec: InferenceServiceSpec, http: list[dict]) -> list[dict[str, Any]]:
    """spec.gateway: the picker reaches the workers as the router does; the decode pods' sidecar port
    is open to any peer (the gateway's pods, wherever they run: the sidecar asks for the API key as the
    router does, and reaches its own worker over loopback)."""
    if not spec.gateway.enabled:
        return []
    return [{"from": [{"podSelector": {"matchLabels": own | {LABEL_ROLE: PICKER}}}], "ports": http},
            {"ports": [{"protocol": "TCP", "port": SIDECAR_PORT_NAME}]}]


def network_policy(meta: dict, spec: InferenceServiceSpec, config: OperatorConfig) -> Manifest:
    """Ingress to the worker pods: the service's own workers (_worker_rules), its router and the
    operator on http."""
    name = meta["name"]
    own = {LABEL_SERVICE: name}
    workers = {"key": LABEL_ROLE, "operator": "In", "values": list(WORKER_ROLES)}
    http = [{"protocol": "TCP", "port": WORKER_PORT_NAME}]
    # vLLM's servers publish their KV events on a port of their own (ZMQ): the router reads them.
    events = [{"protocol": "TCP", "port": KV_EVENTS_PORT_NAME}] if spec.runtime.name is Runtime.VLLM else []
    ingress: list[dict[str, Any]] = [
        *_worker_rules(name, spec, workers),
        {"from": [{"podSelector": {"matchLabels": own | {LABEL_ROLE: ROUTER}}}], "ports": http + events},
        *_gateway_rules(own, spec, http),
    ]
    if config.namespace and config.pod_labels:
        operator_peer = {"namespaceSelector": {"matchLabels": {
                             "kubernetes.io/metadata.name": config.namespace}},
                         "podSelector": {"matchLabels": dict(config.pod_labels)}}
        ingress.append({"from": [operator_peer], "ports": http})
    if spec.network_policy.metrics_from:
        ingress.append({"from": [dict(peer) for peer in spec.network_policy.metrics_from], "ports": http})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(meta, names(name)["workers"], "workers"),
        "spec": {
            "podSelector": {"matchLabels": own, "matchExpressions": [workers]},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
