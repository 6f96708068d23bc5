"""Pieces every child manifest shares: names, labels, owner reference, and the Deployment,
Service and config-volume shapes that workers and router have in common. Pure."""

from __future__ import annotations

from typing import Any

from tandem.contracts.names import (
    ANNOTATION_CONFIG_HASH,
    API_VERSION,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_ROLE,
    LABEL_SERVICE,
    MANAGED_BY,
)

Manifest = dict[str, Any]
CONFIG_DIR = "/etc/tandem"


def names(name: str) -> dict[str, str]:
    """Child object names, one place for the renderer, status and tests."""
    return {
        "config": f"{name}-config",
        "prefill": f"{name}-prefill",
        "decode": f"{name}-decode",
        "router": f"{name}-router",
        "picker": f"{name}-picker",  # spec.gateway: the endpoint picker (render/gateway.py)
        "workers": f"{name}-workers",  # the NetworkPolicy in front of the worker pods
        "internal": f"{name}-internal",  # the Secret the service's router and workers share
        "weights": f"{name}-weights",  # a hub model's shared cache (claim; its download Jobs add the commit)
    }


def selector_labels(name: str, component: str) -> dict[str, str]:
    """A component's Deployment selector: immutable, so it never includes the kv_compat."""
    return {LABEL_SERVICE: name, LABEL_ROLE: component}


def common_labels(name: str, component: str) -> dict[str, str]:
    """The labels on every child; tandem.dev/service is how the operator finds them again."""
    return {
        LABEL_NAME: "tandem",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_SERVICE: name,
    }


def owner_reference(meta: dict) -> dict[str, Any]:
    """controller=true so the garbage collector deletes children with the CR."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(meta: dict, name: str, component: str, extra: dict | None = None) -> dict[str, Any]:
    """A child's metadata: in the CR's namespace, labelled, owned by the CR."""
    labels = common_labels(meta["name"], component) | (extra or {})
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(meta)],
    }


def component_object(meta: dict, component: str, api_version: str, kind: str, spec: dict[str, Any]) -> Manifest:
    """An object of one component (its Deployment, Service, PodDisruptionBudget): named for the
    component, labelled with its role, owned by the CR."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": metadata(meta, names(meta["name"])[component], component, {LABEL_ROLE: component}),
        "spec": spec,
    }


def deployment(meta: dict, component: str, replicas: int | None, pod_labels: dict[str, str],
               config_hash: str, pod_spec: dict[str, Any],
               rollout: dict[str, Any] | None = None) -> Manifest:
    """A component's Deployment; the config hash on the pod template rolls it when its file changes.
    Without `replicas` the field is left out: whoever else sets it (an HPA, KEDA) owns it."""
    return component_object(meta, component, "apps/v1", "Deployment", {
        **({} if replicas is None else {"replicas": replicas}),
        "selector": {"matchLabels": selector_labels(meta["name"], component)},
        **(rollout or {}),
        "revisionHistoryLimit": 3,
        "template": {
            "metadata": {"labels": pod_labels, "annotations": {ANNOTATION_CONFIG_HASH: config_hash}},
            "spec": pod_spec,
        },
    })


def service(meta: dict, component: str, port: int, **head: Any) -> Manifest:
    """A component's Service on its `http` port; `head` comes first in the spec (type, clusterIP)."""
    return component_object(meta, component, "v1", "Service", {
        **head,
        "selector": selector_labels(meta["name"], component),
        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
    })


def config_volume(name: str, key: str) -> dict[str, Any]:
    """The ConfigMap volume holding only this component's file, seen as config.yaml."""
    return {
        "name": "config",
        "configMap": {"name": names(name)["config"], "items": [{"key": key, "path": "config.yaml"}]},
    }


def config_mount() -> dict[str, Any]:
    return {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}


def pod_identity_env() -> list[dict[str, Any]]:
    """POD_NAME and POD_NAMESPACE from the downward API: logs and discovery name the pod."""
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def resources(amounts: dict[str, str]) -> dict[str, dict[str, str]]:
    """Requests equal to limits (Guaranteed QoS where cpu and memory are both set)."""
    if not amounts:
        return {}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def pod_settings(settings: Any, service_account: str | None = None) -> dict[str, Any]:
    """The pod-spec fields a platform sets per component (spec/pod.py): priority, runtime class, pull
    secrets and ServiceAccount (`service_account` when the spec names none)."""
    out: dict[str, Any] = {}
    if settings.priority_class_name:
        out["priorityClassName"] = settings.priority_class_name
    if settings.runtime_class_name:
        out["runtimeClassName"] = settings.runtime_class_name
    if settings.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": ref.name} for ref in settings.image_pull_secrets]
    account = settings.service_account_name or service_account
    if account:
        out["serviceAccountName"] = account
    return out


def disruption_budget(meta: dict, component: str, budget: Any) -> Manifest:
    """A component's PodDisruptionBudget: how many of its pods a node drain may take at once."""
    return component_object(meta, component, "policy/v1", "PodDisruptionBudget", {
        **budget.budget(), "selector": {"matchLabels": selector_labels(meta["name"], component)}})
