"""The real API server takes spec.autoscaling's schema (CEL compiles, within its cost budget), applies
its defaults as AutoscalingSpec does, and refuses bad specs with the messages written for people.

spec.autoscaling is not in the InferenceService CRD yet (the lead wires it in); this installs a
scratch CRD whose spec is exactly that schema, so the schema is judged by the API server itself.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.operator.autoscaling.spec import SCHEMA, apply_defaults

pytestmark = pytest.mark.cluster

GROUP, PLURAL, KIND = "planner.test.tandem.dev", "autoscalingprobes", "AutoscalingProbe"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP, "scope": "Namespaced",
        "names": {"kind": KIND, "plural": PLURAL, "singular": "autoscalingprobe", "listKind": f"{KIND}List"},
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
            "type": "object",
            "properties": {"spec": {"type": "object", "properties": {"autoscaling": SCHEMA}}},
        }}}],
    },
}

INVALID = [
    ("no-role", {}, "autoscaling: configure prefill, decode or both"),
    ("operator-mode-without-max", {"decode": {"minReplicas": 2}},
     "autoscaling.decode.maxReplicas is required when autoscaling.decode.mode is Operator"),
    ("min-above-max", {"prefill": {"minReplicas": 5, "maxReplicas": 2}},
     "autoscaling.prefill.minReplicas must not exceed autoscaling.prefill.maxReplicas"),
    ("decode-to-zero", {"decode": {"minReplicas": 0, "maxReplicas": 4}},
     "autoscaling.decode.minReplicas and maxReplicas must be at least 1"),
    ("window-shorter-than-interval", {"intervalSeconds": 60, "windowSeconds": 30, "decode": {"maxReplicas": 2}},
     "autoscaling.windowSeconds must be at least intervalSeconds"),
    ("too-many-replicas", {"decode": {"maxReplicas": 5000}}, "spec.autoscaling.decode.maxReplicas"),
    ("percentile-out-of-range", {"targets": {"itl": {"percentile": 100}}, "decode": {"maxReplicas": 2}},
     "spec.autoscaling.targets.itl.percentile"),
    ("zero-latency-target", {"targets": {"ttft": {"seconds": 0}}, "decode": {"maxReplicas": 2}},
     "spec.autoscaling.targets.ttft.seconds"),
    ("unknown-mode", {"prefill": {"mode": "Manual", "maxReplicas": 2}}, "Unsupported value"),
    ("zero-step", {"decode": {"maxReplicas": 2, "scaleDown": {"maxStep": 0}}},
     "spec.autoscaling.decode.scaleDown.maxStep"),
]


@pytest.fixture(scope="module")
def probe_crd(k8s):
    k8s.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(CRD))
    try:
        k8s.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")
        with k8s.api_client() as api:
            yield client.CustomObjectsApi(api)
    finally:
        k8s.kubectl("delete", "crd", f"{PLURAL}.{GROUP}", "--wait=false", check=False)


def _create(objs, namespace: str, name: str, autoscaling: dict) -> dict:
    body = {"apiVersion": f"{GROUP}/v1", "kind": KIND, "metadata": {"name": name},
            "spec": {"autoscaling": autoscaling}}
    return objs.create_namespaced_custom_object(GROUP, "v1", namespace, PLURAL, body, dry_run="All")


@pytest.mark.parametrize(("case", "autoscaling", "expected"), INVALID, ids=[c[0] for c in INVALID])
def test_bad_autoscaling_is_refused_with_a_message_a_person_understands(probe_crd, namespace, case, autoscaling,
                                                                        expected):
    with pytest.raises(ApiException) as err:
        _create(probe_crd, namespace, case, autoscaling)
    assert err.value.status == 422, err.value.body
    message = json.loads(err.value.body)["message"]
    assert expected in message, message


def test_server_defaults_are_the_typed_apis(probe_crd, namespace):
    for autoscaling in ({"decode": {"maxReplicas": 8}},
                        {"prefill": {"maxReplicas": 4}, "decode": {"mode": "External"}},
                        {"targets": {"ttft": {"seconds": 0.5}}, "prefill": {"minReplicas": 0, "maxReplicas": 0}}):
        created = _create(probe_crd, namespace, "defaults", autoscaling)
        assert created["spec"]["autoscaling"] == apply_defaults(SCHEMA, copy.deepcopy(autoscaling))
