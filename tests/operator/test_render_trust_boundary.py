"""The service's trust boundary as rendered: every router and worker takes the internal secret from
the service's own Secret (never from the ConfigMap or argv), the tcp KV port is declared, and the
NetworkPolicy lets only the service's pods and the operator reach the workers."""

from __future__ import annotations

import json

from tandem.contracts.internal_auth import SECRET_ENV
from tandem.contracts.names import KV_PORT
from tandem.operator.config import OperatorConfig
from tandem.operator.render import internal_secret, render

OPERATOR = OperatorConfig(namespace="tandem-system",
                          pod_labels=(("app.kubernetes.io/component", "operator"),
                                      ("app.kubernetes.io/name", "tandem")))


def _by(manifests: list[dict], kind: str, name: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def _container(out: list[dict], name: str) -> dict:
    return _by(out, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


def test_router_and_workers_take_the_secret_from_the_services_secret(typed, meta):
    out = render(meta, typed({"model": {"path": "/m"}}), OPERATOR)
    for name in ("llama-prefill", "llama-decode", "llama-router"):
        env = {e["name"]: e for e in _container(out, name)["env"]}
        assert env[SECRET_ENV] == {"name": SECRET_ENV, "valueFrom": {
            "secretKeyRef": {"name": "llama-internal", "key": "secret"}}}
    rendered = json.dumps(out)
    assert "stringData" not in rendered  # the value is never in what render returns


def test_the_secret_is_random_owned_and_long(meta):
    a, b = internal_secret(meta), internal_secret(meta)
    assert a["metadata"]["name"] == "llama-internal" and a["metadata"]["ownerReferences"][0]["uid"]
    assert a["stringData"]["secret"] != b["stringData"]["secret"]
    assert len(a["stringData"]["secret"]) >= 32


def test_a_role_cannot_override_the_secret(typed, meta):
    """The CRD refuses it at kubectl apply (test_crd_validation_refuses_bad_specs); the renderer
    drops it even from a spec that got past an older CRD."""
    spec = typed({"model": {"path": "/m"}, "decode": {"env": [{"name": SECRET_ENV, "value": "x" * 20}]}})
    env = [e for e in _container(render(meta, spec, OPERATOR), "llama-decode")["env"] if e["name"] == SECRET_ENV]
    assert env == [{"name": SECRET_ENV, "valueFrom": {
        "secretKeyRef": {"name": "llama-internal", "key": "secret"}}}]


def test_tcp_workers_declare_the_kv_port_and_their_config_names_it(typed, meta):
    """Prefill serves its prompts' KV there; decode its sequences' when it migrates them out."""
    import yaml

    out = render(meta, typed({"model": {"path": "/m"}, "kvTransfer": {"backend": "tcp"}}), OPERATOR)
    for role in ("prefill", "decode"):
        ports = {p["name"]: p["containerPort"] for p in _container(out, f"llama-{role}")["ports"]}
        assert ports == {"http": 8000, "kv": KV_PORT}
    cfg = yaml.safe_load(_by(out, "ConfigMap", "llama-config")["data"]["prefill.yaml"])
    assert cfg["kv_port"] == KV_PORT


def test_network_policy_admits_only_the_service_and_the_operator(typed, meta):
    spec = typed({"model": {"path": "/m"}, "networkPolicy": {"metricsFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}})
    policy = _by(render(meta, spec, OPERATOR), "NetworkPolicy", "llama-workers")["spec"]
    workers = {"key": "tandem.dev/role", "operator": "In", "values": ["prefill", "decode"]}
    assert policy["podSelector"] == {"matchLabels": {"tandem.dev/service": "llama"},
                                     "matchExpressions": [workers]}
    assert policy["policyTypes"] == ["Ingress"]
    rules = policy["ingress"]
    # the service's own workers: every port (KV over the tcp port or UCX's ephemeral ones)
    assert rules[0] == {"from": [{"podSelector": {"matchLabels": {"tandem.dev/service": "llama"},
                                                  "matchExpressions": [workers]}}]}
    http = [{"protocol": "TCP", "port": "http"}]
    assert rules[1] == {"from": [{"podSelector": {"matchLabels": {
        "tandem.dev/service": "llama", "tandem.dev/role": "router"}}}], "ports": http}
    assert rules[2]["ports"] == http and rules[2]["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "tandem-system"}}
    assert rules[2]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert rules[3]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"} and rules[3]["ports"] == http
    assert len(rules) == 4


def test_network_policy_can_be_turned_off(typed, meta):
    out = render(meta, typed({"model": {"path": "/m"}, "networkPolicy": {"enabled": False}}), OPERATOR)
    assert not [m for m in out if m["kind"] == "NetworkPolicy"]


def test_without_knowing_where_the_operator_runs_no_operator_rule(typed, meta):
    policy = _by(render(meta, typed({"model": {"path": "/m"}}), OperatorConfig()), "NetworkPolicy",
                 "llama-workers")["spec"]
    assert len(policy["ingress"]) == 2


def test_the_rendezvous_port_of_a_group_spanning_nodes_admits_only_its_own_leader_worker_set(typed, meta):
    """Issue 28.1: rank 0's store takes no pickle and checks a seal, and only the pods of the role's own
    LeaderWorkerSet reach its port; the service's other workers keep every other port."""
    spec = typed({"model": {"path": "/m"},
                  "decode": {"gpus": 4, "parallelism": {"tensor": 8, "nodes": 2}}})
    rules = _by(render(meta, spec, OPERATOR), "NetworkPolicy", "llama-workers")["spec"]["ingress"]
    workers = rules[0]
    assert {"protocol": "TCP", "port": 29500} not in workers["ports"]
    tcp = [(p["port"], p["endPort"]) for p in workers["ports"] if p["protocol"] == "TCP"]
    assert tcp == [(1, 29499), (29501, 65535)]
    assert {p["protocol"] for p in workers["ports"]} == {"TCP", "UDP", "SCTP"}
    assert rules[1] == {"from": [{"podSelector": {"matchLabels": {
        "tandem.dev/service": "llama", "leaderworkerset.sigs.k8s.io/name": "llama-decode"}}}],
        "ports": [{"protocol": "TCP", "port": 29500}]}
    assert rules[2]["from"][0]["podSelector"]["matchLabels"]["tandem.dev/role"] == "router"
