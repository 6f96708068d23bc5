"""spec.<role>.parallelism rendered (pure, no cluster): a group that fits a node is one pod with
`tensor` GPUs; one that spans nodes is a LeaderWorkerSet whose leader takes requests, whose pods
go to distinct nodes (and one topology domain when asked), and that counts and scales in groups."""

from __future__ import annotations

import yaml
from tandem.contracts.names import LABEL_GROUP_MEMBER, RENDEZVOUS_PORT, serves_requests
from tandem.operator.config import OperatorConfig
from tandem.operator.group_pods import ready_groups, removed_by_scale_down
from tandem.operator.render import render, stale_workloads
from tandem.operator.render.group import LWS_GROUP_KEY_LABEL, LWS_NAME_LABEL
from tandem.operator.status import role_condition, role_observation

CONFIG = OperatorConfig(image_repository="registry.local/tandem", image_tag="1.2.3", pull_policy="IfNotPresent")
GPU_POOL = {"nodeSelector": {"tandem.dev/pool": "decode"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}


def _by(manifests: list[dict], kind: str, name: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def _kinds(manifests: list[dict]) -> set[tuple[str, str]]:
    return {(m["kind"], m["metadata"]["name"]) for m in manifests}


def _spec(decode: dict) -> dict:
    return {"model": {"path": "/m"}, "prefill": {"gpus": 1}, "decode": {**GPU_POOL, **decode}}


def test_a_group_that_fits_one_node_is_one_pod_with_every_gpu_and_the_tensor_size_in_its_config(typed, meta):
    out = render(meta, typed(_spec({"gpus": 4, "parallelism": {"tensor": 4}})), CONFIG)
    assert ("LeaderWorkerSet", "llama-decode") not in _kinds(out)
    pod = _by(out, "Deployment", "llama-decode")["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    files = _by(out, "ConfigMap", "llama-config")["data"]
    assert yaml.safe_load(files["decode.yaml"])["tensor_parallel"] == 4
    assert "tensor_parallel" not in yaml.safe_load(files["prefill.yaml"]), "tensor 1: the flag's default"


def test_a_group_that_spans_nodes_is_a_leader_worker_set_of_whole_groups(typed, meta):
    spec = typed(_spec({"replicas": 3, "gpus": 4, "parallelism": {"tensor": 8, "nodes": 2}}))
    out = render(meta, spec, CONFIG)
    assert ("Deployment", "llama-decode") not in _kinds(out) and ("Deployment", "llama-prefill") in _kinds(out)
    lws = _by(out, "LeaderWorkerSet", "llama-decode")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["replicas"] == 3, "replicas count groups"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart", "a rank that dies restarts its group"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated", "the leader is ready only once its followers joined"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == meta["uid"]
    for member, tmpl in (("leader", template["leaderTemplate"]), ("follower", template["workerTemplate"])):
        assert tmpl["metadata"]["labels"][LABEL_GROUP_MEMBER] == member
        assert tmpl["metadata"]["labels"]["tandem.dev/role"] == "decode"
        assert tmpl["metadata"]["annotations"]["tandem.dev/config-hash"]
        pod = tmpl["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "4", "tensor / nodes GPUs per pod"
        assert {"name": "dist", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"} in c["ports"]
        assert pod["nodeSelector"] == {"tandem.dev/pool": "decode"}
        apart = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert apart == [{"labelSelector": {"matchLabels": {LWS_NAME_LABEL: "llama-decode"}},
                          "matchLabelKeys": [LWS_GROUP_KEY_LABEL], "topologyKey": "kubernetes.io/hostname"}]
        assert "podAffinity" not in pod["affinity"], "no topologyKey: no domain to share"
        assert "topologySpreadConstraints" not in pod
    assert yaml.safe_load(_by(out, "ConfigMap", "llama-config")["data"]["decode.yaml"])["tensor_parallel"] == 8
    # The Service is the pods' subdomain: followers resolve the leader before anything is Ready.
    assert _by(out, "Service", "llama-decode")["spec"]["publishNotReadyAddresses"] is True
    assert "publishNotReadyAddresses" not in _by(out, "Service", "llama-prefill")["spec"]


def test_a_topology_key_keeps_a_groups_pods_in_one_domain_beside_the_users_affinity(typed, meta):
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}}
    spec = typed(_spec({"gpus": 8, "affinity": user,
                        "parallelism": {"tensor": 16, "nodes": 2, "topologyKey": "nvidia.com/gpu.clique"}}))
    lws = _by(render(meta, spec, CONFIG), "LeaderWorkerSet", "llama-decode")
    affinity = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["affinity"]
    assert affinity["nodeAffinity"] == user["nodeAffinity"]
    together = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together == [{"labelSelector": {"matchLabels": {LWS_NAME_LABEL: "llama-decode"}},
                         "matchLabelKeys": [LWS_GROUP_KEY_LABEL], "topologyKey": "nvidia.com/gpu.clique"}]


def test_kv_compat_and_external_replicas_carry_over_to_groups(typed, meta):
    spec = typed(_spec({"gpus": 1, "parallelism": {"tensor": 2, "nodes": 2}}))
    out = render(meta, spec, CONFIG, replicas={"decode": None})
    lws = _by(out, "LeaderWorkerSet", "llama-decode")
    assert "replicas" not in lws["spec"], "External mode: an HPA owns the LeaderWorkerSet's scale"
    prefill_gen = _by(out, "Deployment", "llama-prefill")["spec"]["template"]["metadata"]["labels"]["tandem.dev/kv-compat"]
    leader_gen = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]["tandem.dev/kv-compat"]
    assert leader_gen == prefill_gen, "prefill pairs with the groups' leaders as with any decode pod"
    # the NetworkPolicy selects workers by role: leaders and followers alike
    policy = _by(out, "NetworkPolicy", "llama-workers")
    assert policy["spec"]["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]


def test_the_workload_a_role_no_longer_uses_is_named_for_pruning(typed, meta):
    one = stale_workloads(meta, typed(_spec({"gpus": 1})))
    assert {(s["kind"], s["metadata"]["name"]) for s in one} == {
        ("LeaderWorkerSet", "llama-prefill"), ("LeaderWorkerSet", "llama-decode")}
    spans = stale_workloads(meta, typed(_spec({"gpus": 1, "parallelism": {"tensor": 2, "nodes": 2}})))
    assert {(s["kind"], s["metadata"]["name"]) for s in spans} == {
        ("LeaderWorkerSet", "llama-prefill"), ("Deployment", "llama-decode")}


def _pod(name: str, group: int, member: str, ready: bool) -> dict:
    return {"metadata": {"name": name, "labels": {"leaderworkerset.sigs.k8s.io/group-index": str(group),
                                                  LABEL_GROUP_MEMBER: member}},
            "status": {"podIP": "127.50.0.9", "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_a_group_is_ready_only_when_every_pod_is_and_status_counts_groups():
    lws = {"kind": "LeaderWorkerSet", "spec": {"replicas": 2, "leaderWorkerTemplate": {"size": 2}}}
    pods = [_pod("d-0", 0, "leader", True), _pod("d-0-1", 0, "follower", True),
            _pod("d-1", 1, "leader", True), _pod("d-1-1", 1, "follower", False)]
    obs = role_observation(lws, pods)
    assert (obs.replicas, obs.ready, obs.group_size) == (2, 1, 2)
    assert [p["metadata"]["name"] for p in obs.pods] == ["d-0", "d-1"], "leaders take requests"
    assert [p["metadata"]["name"] for p in obs.followers] == ["d-0-1", "d-1-1"]
    assert not serves_requests(pods[1]) and serves_requests(pods[0])
    cond = role_condition("decode", obs, 2)
    assert cond["reason"] == "MinimumReplicasReady"
    assert cond["message"].startswith("1/2 decode groups (2 pods each, ready when all are) ready")
    assert ready_groups(pods[:3], 2) == 1, "a leader alone is not a ready group"


def test_a_scale_down_names_the_leaders_of_the_highest_groups():
    leaders = [_pod(f"d-{i}", i, "leader", True) for i in (0, 3, 1, 2)]
    assert removed_by_scale_down(leaders, keep=2) == ("d-3", "d-2")
    assert removed_by_scale_down(leaders, keep=4) == ()
