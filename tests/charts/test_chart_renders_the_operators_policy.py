"""The chart's `policy` values reach the operator as TANDEM_POLICY, which the operator reads as its
policy (operator/policy.py): by default nothing that reaches a node beyond the operator's own images;
an admin's per-namespace entries as written; and the values schema refuses a policy the operator
could not read, at `helm install`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tandem.operator.policy import Policy, Rules
from tandem.testing.chart import CHART_DIR, operator_container, render, run_helm


def _policy(helm_bin: Path, **values: object) -> Policy:
    env = {e["name"]: e.get("value") for e in operator_container(render(helm_bin, **values))["env"]}
    return Policy.from_json(env["TANDEM_POLICY"])


def test_the_default_install_allows_nothing_that_reaches_a_node(helm_bin: Path) -> None:
    assert _policy(helm_bin) == Policy()
    assert _policy(helm_bin).rules("any") == Rules()


def test_an_admins_policy_reaches_the_operator_as_written(helm_bin: Path) -> None:
    rdma = {"hostPaths": ["/mnt/models"], "ipcLock": True, "hostNetwork": True}
    policy = _policy(helm_bin, **{"policy.default.images": ["registry.example.com/"],
                                  "policy.namespaces": {"rdma-serving": rdma}})
    assert policy.rules("team-a") == Rules(images=("registry.example.com/",))
    assert policy.rules("rdma-serving") == Rules(host_paths=("/mnt/models",), images=("registry.example.com/",),
                                                 ipc_lock=True, host_network=True)


@pytest.mark.parametrize("key, value, message", [
    ("policy.default.hostPath", '["/mnt"]', "hostPath"),
    ("policy.default.hostPaths", '["mnt/models"]', "/policy/default/hostPaths/0"),
    ("policy.default.ipcLock", '"yes"', "/policy/default/ipcLock"),
    ("policy.namespaces", '{"Not_A_Namespace": {}}', "Not_A_Namespace"),
    ("policy.namespaces", '{"a": {"images": "quay.io/x"}}', "/policy/namespaces/a/images"),
])
def test_the_values_schema_refuses_a_policy_the_operator_could_not_read(helm_bin: Path, key: str, value: str,
                                                                          message: str) -> None:
    proc = run_helm(helm_bin, "template", "rel", str(CHART_DIR), "--set-json", f"{key}={value}", check=False)
    assert proc.returncode != 0, f"{key}={value} was accepted"
    assert message in proc.stderr, proc.stderr
    with pytest.raises(Exception):  # noqa: B017 (what the schema refuses, the operator refuses too)
        doc = json.loads(value)
        Policy.from_json(json.dumps(_nest(key.removeprefix("policy."), doc)))


def _nest(dotted: str, value: object) -> dict:
    *parents, leaf = dotted.split(".")
    out: dict = {leaf: value}
    for p in reversed(parents):
        out = {p: out}
    return out
