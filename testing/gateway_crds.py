"""Stand-ins for the CRDs a gateway installs (Gateway API's HTTPRoute, the Inference Extension's
InferencePool), for the control-plane tests: written here, not fetched, with structural schemas of the
fields Tandem renders and the constraints the v1 APIs put on them (a pool's targetPorts: 1 to 8 ports;
its endpointPickerRef's failureMode: FailOpen or FailClose), so the API server checks the operator's
manifests as the real CRDs would on those fields. Anything else is preserved unchecked.
"""

from __future__ import annotations

from typing import Any

_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_OPEN = {"x-kubernetes-preserve-unknown-fields": True}


def _crd(group: str, kind: str, plural: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        # *.k8s.io groups are protected: a CRD in one must say whether its API was approved
        "metadata": {"name": f"{plural}.{group}",
                     "annotations": {"api-approved.kubernetes.io": "unapproved, a test stand-in for the gateway's CRD"}},
        "spec": {
            "group": group,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": spec, "status": {"type": "object", **_OPEN}}}},
            }],
        },
    }


INFERENCE_POOL = _crd("inference.networking.k8s.io", "InferencePool", "inferencepools", {
    "type": "object",
    "required": ["selector", "targetPorts", "endpointPickerRef"],
    "properties": {
        "selector": {"type": "object", "required": ["matchLabels"], "properties": {
            "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
            "type": "object", "required": ["number"], "properties": {"number": _PORT}}},
        "appProtocol": {"type": "string"},
        "endpointPickerRef": {"type": "object", "required": ["name", "port"], "properties": {
            "group": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"},
            "port": {"type": "object", "required": ["number"], "properties": {"number": _PORT}},
            "failureMode": {"type": "string", "enum": ["FailOpen", "FailClose"]}}},
    },
})

HTTP_ROUTE = _crd("gateway.networking.k8s.io", "HTTPRoute", "httproutes", {
    "type": "object",
    "properties": {
        "parentRefs": {"type": "array", "maxItems": 32, "items": {"type": "object", "required": ["name"], **_OPEN}},
        "hostnames": {"type": "array", "items": {"type": "string"}},
        "rules": {"type": "array", "maxItems": 16, "items": {"type": "object", "properties": {
            "matches": {"type": "array", "items": {"type": "object", **_OPEN}},
            "backendRefs": {"type": "array", "items": {"type": "object", "required": ["name"], **_OPEN}},
        }}},
    },
})

CRDS = (INFERENCE_POOL, HTTP_ROUTE)
