"""The real API server takes the InferenceService CRD with spec.autoscaling (CEL compiles, within its
cost budget), applies the defaults the typed spec declares, and refuses bad specs with the messages
written for people: the same messages the parser gives for the rules it enforces too."""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.operator.autoscaling.spec import AutoscalingSpec
from tandem.operator.spec import SpecError, to_json

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "tandem.dev", "v1alpha1", "inferenceservices"

# (case, spec.autoscaling, the API server's message, whether the parser refuses it too)
INVALID = [
    ("no-role", {}, "autoscaling: configure prefill, decode or both", True),
    ("operator-mode-without-max", {"decode": {"minReplicas": 2}},
     "autoscaling.decode.maxReplicas is required when autoscaling.decode.mode is Operator", True),
    ("min-above-max", {"prefill": {"minReplicas": 5, "maxReplicas": 2}},
     "autoscaling.prefill.minReplicas must not exceed autoscaling.prefill.maxReplicas", True),
    ("decode-to-zero", {"decode": {"minReplicas": 0, "maxReplicas": 4}},
     "autoscaling.decode.minReplicas and maxReplicas must be at least 1", True),
    ("window-shorter-than-interval", {"intervalSeconds": 60, "windowSeconds": 30, "decode": {"maxReplicas": 2}},
     "autoscaling.windowSeconds must be at least intervalSeconds", True),
    ("too-many-replicas", {"decode": {"maxReplicas": 5000}}, "spec.autoscaling.decode.maxReplicas", True),
    ("percentile-out-of-range", {"targets": {"itl": {"percentile": 100}}, "decode": {"maxReplicas": 2}},
     "spec.autoscaling.targets.itl.percentile", True),
    ("zero-latency-target", {"targets": {"ttft": {"seconds": 0}}, "decode": {"maxReplicas": 2}},
     "spec.autoscaling.targets.ttft.seconds", True),
    ("unknown-mode", {"prefill": {"mode": "Manual", "maxReplicas": 2}}, "Unsupported value", True),
    ("zero-step", {"decode": {"maxReplicas": 2, "scaleDown": {"maxStep": 0}}},
     "spec.autoscaling.decode.scaleDown.maxStep", True),
    ("prefill-grace-below-a-kv-pull", {"decode": {"maxReplicas": 2}},
     "spec.prefill.terminationGracePeriodSeconds", False),
]


@pytest.fixture(scope="module")
def objs(k8s, crd_installed):
    with k8s.api_client() as api:
        yield client.CustomObjectsApi(api)


def _create(objs, namespace: str, name: str, autoscaling: dict, **extra) -> dict:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"path": "/m"}, "autoscaling": autoscaling, **extra}}
    return objs.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, dry_run="All")


@pytest.mark.parametrize(("case", "autoscaling", "expected", "parser_too"), INVALID, ids=[c[0] for c in INVALID])
def test_bad_autoscaling_is_refused_with_a_message_a_person_understands(objs, namespace, case, autoscaling,
                                                                        expected, parser_too):
    extra = {"prefill": {"terminationGracePeriodSeconds": 5}} if case.startswith("prefill-grace") else {}
    with pytest.raises(ApiException) as err:
        _create(objs, namespace, case, autoscaling, **extra)
    assert err.value.status == 422, err.value.body
    message = json.loads(err.value.body)["message"]
    assert expected in message, message
    if parser_too:
        with pytest.raises(SpecError) as parsed:
            AutoscalingSpec.from_dict(autoscaling)
        assert str(parsed.value).split(": ", 1)[1] in message or parsed.value.path in message, (
            str(parsed.value), message)


def test_server_defaults_are_the_typed_apis(objs, namespace):
    for autoscaling in ({"decode": {"maxReplicas": 8}},
                        {"prefill": {"maxReplicas": 4}, "decode": {"mode": "External"}},
                        {"targets": {"ttft": {"seconds": 0.5}}, "prefill": {"minReplicas": 0, "maxReplicas": 0}}):
        created = _create(objs, namespace, "defaults", autoscaling)
        assert created["spec"]["autoscaling"] == to_json(AutoscalingSpec.from_dict(copy.deepcopy(autoscaling)))
