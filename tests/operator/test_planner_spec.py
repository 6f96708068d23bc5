"""spec.autoscaling: the schema's defaults are the typed API's defaults, and bad specs are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tandem.operator.autoscaling.spec import SCHEMA, AutoscalingSpec, Behavior, Mode


def test_a_minimal_spec_takes_the_schema_defaults():
    s = AutoscalingSpec.from_dict({"decode": {"maxReplicas": 8}})
    assert set(s.roles) == {"decode"}, "prefill left out: its replicas stay fixed"
    d = s.roles["decode"]
    assert (d.mode, d.min_replicas, d.max_replicas) == (Mode.OPERATOR, 1, 8)
    assert d.scale_up == Behavior(0, 4, 100) and d.scale_down == Behavior(300, 1, 20)
    assert (s.interval_s, s.window_s, s.tolerance) == (15, 60, 0.1)
    assert (s.ttft.seconds, s.ttft.percentile, s.itl.seconds) == (2.0, 90, 0.1)
    assert AutoscalingSpec.from_dict({"prefill": {"maxReplicas": 4}}).roles["prefill"].min_replicas == 0


@pytest.mark.parametrize(("spec", "message"), [
    ({}, "configure prefill, decode or both"),
    ({"decode": {}}, "maxReplicas is required"),
    ({"prefill": {"minReplicas": 5, "maxReplicas": 2}}, "must not exceed"),
])
def test_bad_specs_are_refused_with_the_crd_message(spec, message):
    with pytest.raises(ValueError, match=message):
        AutoscalingSpec.from_dict(spec)


def test_external_mode_needs_no_limits():
    s = AutoscalingSpec.from_dict({"decode": {"mode": "External"}})
    assert s.roles["decode"].mode is Mode.EXTERNAL and s.roles["decode"].max_replicas is None


@pytest.mark.parametrize(("current", "percent", "step", "limit"), [(1, 100, 4, 4), (10, 100, 4, 10),
                                                                   (200, 20, 1, 40), (3, 20, 1, 1)])
def test_the_step_limit_is_the_larger_of_pods_and_percent(current, percent, step, limit):
    assert Behavior(0, step, percent).step_limit(current) == limit


def _walk(schema: dict, path: str = "autoscaling"):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")


def test_the_schema_documents_every_field_and_bounds_every_number():
    for path, node in _walk(SCHEMA):
        assert node.get("description"), f"{path} has no description"
        if node.get("type") in ("integer", "number"):
            assert "minimum" in node and "maximum" in node, f"{path} is unbounded"


def test_every_rule_has_a_message_naming_its_field():
    rules = [(p, r) for p, n in _walk(SCHEMA) for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 6
    for path, rule in rules:
        assert rule["message"].startswith("autoscaling"), (path, rule)


def test_the_planner_imports_neither_torch_nor_the_kubernetes_client():
    """It runs inside the operator (no torch) and in the simulator (no cluster): pure code only."""
    code = ("import sys, tandem.operator.autoscaling.planner; "
            "heavy = [m for m in ('torch', 'transformers', 'kopf', 'kubernetes') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
