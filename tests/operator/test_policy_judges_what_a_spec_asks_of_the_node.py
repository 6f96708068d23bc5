"""The operator's policy (operator/policy.py): what an InferenceService may ask of a node, judged as a
pure function of (spec, namespace, policy) before anything is rendered. Secure by default: no
hostPath, no host network, no IPC_LOCK (root), no image but the operator's own, no named
ServiceAccount; a namespace's entry overrides the cluster-wide default key by key."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tandem.operator.cli import add_arguments, operator_config
from tandem.operator.config import OperatorConfig
from tandem.operator.policy import ANY, Policy, PolicyError, Rules, judge

OWN = ("ghcr.io/tandem-dev/tandem-worker", "ghcr.io/tandem-dev/tandem-router")
BASE = {"model": {"path": "/models/m"}, "kvTransfer": {"backend": "tcp"},
        "prefill": {"gpus": 0}, "decode": {"gpus": 0}}
RDMA = {"backend": "nixl", "rdma": {"resourceName": "rdma/ib", "count": 1}}


def _spec(typed, **parts: object) -> object:
    return typed(BASE | parts)


def _fields(violations) -> list[str]:
    return [v.field for v in violations]


def _policy(default: dict | None = None, **namespaces: dict) -> Policy:
    return Policy.from_json(json.dumps({"default": default or {}, "namespaces": namespaces}))


def test_the_default_policy_allows_a_plain_spec_and_nothing_that_reaches_the_node(typed):
    assert judge(_spec(typed), "team-a", Policy(), OWN) == []
    asks = _spec(typed, model={"hostPath": "/"}, kvTransfer=RDMA | {"hostNetwork": True, "ipcLock": True},
                 image={"repository": "evil.example/miner"}, router={"image": {"repository": "evil.example/r"},
                                                                      "serviceAccountName": "deployer"},
                 decode={"gpus": 1, "serviceAccountName": "cloud-reader"}, prefill={"gpus": 1})
    assert sorted(_fields(judge(asks, "team-a", Policy(), OWN))) == sorted([
        "model.hostPath", "kvTransfer.hostNetwork", "kvTransfer.ipcLock", "image.repository",
        "router.image.repository", "router.serviceAccountName", "decode.serviceAccountName"])


def test_a_writable_cache_on_the_node_is_refused_by_default(typed):
    spec = _spec(typed, model={"hub": "org/m", "cache": {"hostPath": {"path": "/var/lib/kubelet"}}})
    (v,) = judge(spec, "team-a", Policy(), OWN)
    assert v.field == "model.cache.hostPath.path"
    assert "/var/lib/kubelet" in v.message and "writableHostPaths" in v.message


def test_a_message_names_the_field_the_namespace_and_how_an_admin_allows_it(typed):
    (v,) = judge(_spec(typed, model={"hostPath": "/"}), "team-a", Policy(), OWN)
    assert v.field == "model.hostPath"
    for words in ("model.hostPath", "'/'", "team-a", "hostPaths", "policy.namespaces.team-a", "policy.default"):
        assert words in v.message


def test_host_paths_are_allowed_under_a_prefix_as_whole_directories(typed):
    policy = _policy({"hostPaths": ["/mnt/models"]})
    for allowed in ("/mnt/models", "/mnt/models/llama"):
        assert judge(_spec(typed, model={"hostPath": allowed}), "ns", policy, OWN) == [], allowed
    for refused in ("/mnt/models-other", "/mnt", "/"):
        assert _fields(judge(_spec(typed, model={"hostPath": refused}), "ns", policy, OWN)) == ["model.hostPath"], \
            refused
    # The CRD and the parser refuse such paths; the judge never trusts a prefix match on one either.
    plain = _spec(typed, model={"hostPath": "/mnt/models"})
    for climbing in ("/mnt/models/../../etc", "/mnt/models/./x", "//mnt/models"):
        spec = dataclasses.replace(plain, model=dataclasses.replace(plain.model, host_path=climbing))
        assert _fields(judge(spec, "ns", policy, OWN)) == ["model.hostPath"], climbing


def test_a_writable_prefix_allows_a_cache_and_a_read_only_model_but_a_read_only_one_no_cache(typed):
    cache = _spec(typed, model={"hub": "org/m", "cache": {"hostPath": {"path": "/var/cache/tandem/x"}}})
    read_only = _policy({"hostPaths": ["/var/cache/tandem"]})
    assert _fields(judge(cache, "ns", read_only, OWN)) == ["model.cache.hostPath.path"]
    writable = _policy({"writableHostPaths": ["/var/cache/tandem"]})
    assert judge(cache, "ns", writable, OWN) == []
    assert judge(_spec(typed, model={"hostPath": "/var/cache/tandem/m"}), "ns", writable, OWN) == []


def test_images_the_operators_own_and_listed_repositories_or_prefixes(typed):
    policy = _policy({"images": ["registry.example.com/team-a/", "quay.io/org/worker"]})
    for repo in ("registry.example.com/team-a/worker", "quay.io/org/worker", OWN[0], OWN[1]):
        assert judge(_spec(typed, image={"repository": repo}), "ns", policy, OWN) == [], repo
    for repo in ("registry.example.com/team-ab/worker", "quay.io/org/worker2", "ghcr.io/tandem-dev/other"):
        assert _fields(judge(_spec(typed, image={"repository": repo}), "ns", policy, OWN)) == ["image.repository"]
    model_image = _spec(typed, model={"image": {"reference": "registry.example.com/models/llama@sha256:" + "a" * 64}})
    assert _fields(judge(model_image, "ns", policy, OWN)) == ["model.image.reference"]
    assert judge(model_image, "ns", _policy({"images": ["registry.example.com/models/"]}), OWN) == []
    assert judge(model_image, "ns", _policy({"images": [ANY]}), OWN) == []


def test_service_accounts_are_named_or_any(typed):
    spec = _spec(typed, router={"serviceAccountName": "edge"}, prefill={"gpus": 0, "serviceAccountName": "reader"})
    assert _fields(judge(spec, "ns", _policy({"serviceAccounts": ["edge"]}), OWN)) == ["prefill.serviceAccountName"]
    assert judge(spec, "ns", _policy({"serviceAccounts": ["edge", "reader"]}), OWN) == []
    assert judge(spec, "ns", _policy({"serviceAccounts": [ANY]}), OWN) == []


def test_forced_pulls_refuse_a_spec_that_would_use_an_image_already_on_the_node(typed):
    policy = _policy({"alwaysPullImages": True, "images": [ANY]})
    car = {"reference": "registry.example.com/tenant-b/model:1"}
    for policy_value in ("Never", "IfNotPresent"):
        spec = _spec(typed, model={"image": car | {"pullPolicy": policy_value}},
                     image={"pullPolicy": policy_value}, router={"image": {"pullPolicy": policy_value}})
        assert sorted(_fields(judge(spec, "ns", policy, OWN))) == [
            "image.pullPolicy", "model.image.pullPolicy", "router.image.pullPolicy"]
    assert judge(_spec(typed, model={"image": car | {"pullPolicy": "Always"}}), "ns", policy, OWN) == []
    assert judge(_spec(typed, model={"image": car}), "ns", policy, OWN) == []


def test_a_namespace_overrides_the_default_key_by_key(typed):
    policy = _policy({"hostPaths": ["/mnt/models"], "images": ["quay.io/org/"]},
                     rdma={"ipcLock": True, "hostNetwork": True, "hostPaths": ["/data/weights"]})
    assert policy.rules("rdma") == Rules(host_paths=("/data/weights",), images=("quay.io/org/",), ipc_lock=True,
                                         host_network=True)
    assert policy.rules("other") == Rules(host_paths=("/mnt/models",), images=("quay.io/org/",))
    rdma = _spec(typed, model={"hostPath": "/mnt/models/m"}, kvTransfer=RDMA | {"hostNetwork": True, "ipcLock": True},
                 prefill={"gpus": 1}, decode={"gpus": 1})
    assert _fields(judge(rdma, "rdma", policy, OWN)) == ["model.hostPath"], "the namespace's list replaces the default's"
    assert sorted(_fields(judge(rdma, "other", policy, OWN))) == ["kvTransfer.hostNetwork", "kvTransfer.ipcLock"]


@pytest.mark.parametrize("text, words", [
    ('{"default": {"hostPath": ["/mnt"]}}', ["hostPath", "hostPaths"]),
    ('{"default": {"hostPaths": ["mnt"]}}', ["absolute"]),
    ('{"default": {"hostPaths": ["/mnt/../etc"]}}', ["normalised"]),
    ('{"default": {"ipcLock": "yes"}}', ["ipcLock", "true or false"]),
    ('{"default": {"images": "quay.io/x"}}', ["images", "list"]),
    ('{"namespaces": {"a": 1}}', ["namespaces.a"]),
    ('{"defaults": {}}', ["defaults"]),
    ("not json", ["JSON"]),
])
def test_a_policy_the_operator_cannot_read_is_refused_with_what_is_wrong(text, words):
    with pytest.raises(PolicyError) as e:
        Policy.from_json(text)
    for word in words:
        assert word in str(e.value)


def test_the_policy_comes_from_the_environment_or_the_flag():
    assert OperatorConfig().policy == Policy()
    env = {"TANDEM_POLICY": json.dumps({"default": {"hostPaths": ["/mnt/models"]}})}
    assert OperatorConfig.from_env(env).policy.rules("x").host_paths == ("/mnt/models",)
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["-A", "--policy", json.dumps({"default": {"ipcLock": True}})])
    assert operator_config(args).policy.rules("x").ipc_lock is True
    with pytest.raises(SystemExit, match="TANDEM_POLICY"):
        operator_config(parser.parse_args(["-A", "--policy", "{"]))


def test_forced_pulls_make_the_namespace_config_pull_always():
    config = OperatorConfig(policy=_policy(strict={"alwaysPullImages": True}))
    assert config.for_namespace("strict").pull_policy == "Always"
    assert config.for_namespace("other") is config


def test_the_examples_pass_the_policy_the_install_guide_shows_and_need_it(typed, examples):
    """docs/install.md's entry for the namespace `serving` lets every example run there; without it
    the examples that reach the node are refused, each for what its header says it needs."""
    documented = _policy(serving={"ipcLock": True, "hostNetwork": True, "hostPaths": ["/mnt/models"],
                                  "images": ["registry.example.com/models/"]})
    needs = {}
    for name, example in examples.items():
        spec = typed(example["spec"])
        assert judge(spec, "serving", documented, OWN) == [], name
        needs[name] = sorted(_fields(judge(spec, "serving", Policy(), OWN)))
    assert needs["cpu"] == [] and needs["hub-shared-cache"] == []
    assert needs["gpu-roce"] == ["kvTransfer.ipcLock"]
    assert needs["gpu-ib-hostnetwork"] == ["kvTransfer.hostNetwork", "kvTransfer.ipcLock", "model.hostPath"]
    assert needs["modelcar-image"] == ["model.image.reference"]
