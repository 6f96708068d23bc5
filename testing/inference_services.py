"""InferenceServices in control-plane tests: create one, read it back, read one of its conditions."""

from __future__ import annotations

from typing import Any

from kubernetes import client

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def create(api: client.ApiClient, ns: str, name: str, spec: dict[str, Any]) -> None:
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        *GVP[:2], ns, GVP[2], {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
                               "metadata": {"name": name}, "spec": spec})


def read(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], ns, GVP[2], name)


def condition(tis: dict[str, Any], type_: str) -> dict[str, Any]:
    """The condition of `type_` in the InferenceService's status ({} until it is written)."""
    return next((c for c in (tis.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})
