"""spec.autoscaling: one declaration gives the CRD's schema and the planner's typed spec; its defaults
and the rules the planner cannot work without hold in both, with the same messages."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tandem.operator.autoscaling.spec import AutoscalingSpec, Behavior, Mode
from tandem.operator.crd import crd
from tandem.operator.spec import InferenceServiceSpec, SpecError
from tandem.operator.spec.autoscaling import RoleScaling
from tandem.operator.spec.openapi import object_schema


def _schema() -> dict:
    """spec.autoscaling as the generated CRD carries it."""
    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return root["properties"]["spec"]["properties"]["autoscaling"]


def test_the_crd_carries_the_typed_declaration():
    assert _schema() == object_schema(AutoscalingSpec) | {"description": _schema()["description"]}


def test_a_minimal_spec_takes_the_schema_defaults():
    s = AutoscalingSpec.from_dict({"decode": {"maxReplicas": 8}})
    assert set(s.roles) == {"decode"}, "prefill left out: its replicas stay fixed"
    d = s.roles["decode"]
    assert (d.mode, d.min_replicas, d.max_replicas) == (Mode.OPERATOR, 1, 8)
    assert d.scale_up == Behavior(stabilization_s=0, max_step=4, max_step_percent=100)
    assert d.scale_down == Behavior(stabilization_s=300, max_step=1, max_step_percent=20)
    assert (s.interval_s, s.window_s, s.tolerance) == (15, 60, 0.1)
    assert (s.ttft.seconds, s.ttft.percentile, s.itl.seconds) == (2.0, 90, 0.1)
    prefill = AutoscalingSpec.from_dict({"prefill": {"maxReplicas": 4}}).roles["prefill"]
    assert (prefill.min_replicas, prefill.target_utilization) == (0, 0.8)


def test_the_inference_service_spec_carries_it():
    spec = InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "autoscaling": {"decode": {"maxReplicas": 3}}})
    assert spec.autoscaling == AutoscalingSpec.from_dict({"decode": {"maxReplicas": 3}})
    assert spec.autoscaling.owns("decode") and not spec.autoscaling.owns("prefill")
    assert InferenceServiceSpec.from_dict({"model": {"path": "/m"}}).autoscaling is None


# The CRD's CEL rules that the planner cannot work without: the parser enforces their Python twins
# with the very same message (test_planner_schema_in_the_api_server checks the API server's side).
REFUSED = [
    ({}, "spec.autoscaling", "autoscaling: configure prefill, decode or both"),
    ({"decode": {}}, "spec.autoscaling.decode",
     "autoscaling.decode.maxReplicas is required when autoscaling.decode.mode is Operator"),
    ({"prefill": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling.prefill",
     "autoscaling.prefill.minReplicas must not exceed autoscaling.prefill.maxReplicas"),
    ({"decode": {"minReplicas": 0, "maxReplicas": 4}}, "spec.autoscaling.decode",
     "autoscaling.decode.minReplicas and maxReplicas must be at least 1"),
    ({"intervalSeconds": 60, "windowSeconds": 30, "decode": {"maxReplicas": 2}}, "spec.autoscaling",
     "autoscaling.windowSeconds must be at least intervalSeconds"),
    ({"prefill": {"mode": "Manual", "maxReplicas": 2}}, "spec.autoscaling.prefill.mode", "must be one of"),
]


@pytest.mark.parametrize(("spec", "path", "message"), REFUSED)
def test_bad_specs_are_refused_with_the_crd_message(spec, path, message):
    with pytest.raises(SpecError) as err:
        AutoscalingSpec.from_dict(spec)
    assert err.value.path == path and message in err.value.problem


def test_every_rule_the_parser_enforces_is_a_rule_of_the_crd():
    def rules(node: dict):
        yield from node.get("x-kubernetes-validations", [])
        for sub in (node.get("properties") or {}).values():
            yield from rules(sub)

    messages = {r["message"] for r in rules(_schema())}
    for _, _, message in REFUSED[:-1]:
        assert any(m.startswith(message) for m in messages), message


def test_external_mode_needs_no_limits():
    s = AutoscalingSpec.from_dict({"decode": {"mode": "External"}})
    assert s.roles["decode"].mode is Mode.EXTERNAL and s.roles["decode"].max_replicas is None
    assert s.external("decode") and not s.owns("decode")


@pytest.mark.parametrize(("current", "percent", "step", "limit"), [(1, 100, 4, 4), (10, 100, 4, 10),
                                                                   (200, 20, 1, 40), (3, 20, 1, 1)])
def test_the_step_limit_is_the_larger_of_pods_and_percent(current, percent, step, limit):
    assert Behavior(stabilization_s=0, max_step=step, max_step_percent=percent).step_limit(current) == limit


def test_clamp_holds_min_and_max():
    rs = AutoscalingSpec.from_dict({"decode": {"minReplicas": 2, "maxReplicas": 5}}).decode
    assert isinstance(rs, RoleScaling) and [rs.clamp(n) for n in (0, 3, 9)] == [2, 3, 5]


def _walk(schema: dict, path: str = "autoscaling"):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")


def test_the_schema_documents_every_field_and_bounds_every_number():
    for path, node in _walk(_schema()):
        assert node.get("description"), f"{path} has no description"
        if node.get("type") in ("integer", "number"):
            assert "minimum" in node and "maximum" in node, f"{path} is unbounded"


def test_every_rule_has_a_message_naming_its_field():
    rules = [(p, r) for p, n in _walk(_schema()) for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 7
    for path, rule in rules:
        assert rule["message"].startswith("autoscaling"), (path, rule)


def test_the_planner_imports_neither_torch_nor_the_kubernetes_client():
    """It runs inside the operator (no torch) and in the simulator (no cluster): pure code only."""
    code = ("import sys, tandem.planning.autoscaling.planner; "
            "heavy = [m for m in ('torch', 'transformers', 'kopf', 'kubernetes') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
