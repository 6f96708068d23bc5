"""A follower rank of a 2-node decode group dies while streams run: the LWS controller recreates the
whole group (its leader too), no client is left hanging, and the group comes back Ready.

Real processes stand in for the pods (KWOK runs no containers): a prefill worker, the leader of each
decode group (rank 0: the pod that takes requests) and a router finding them through the API server.
A follower runs no process here: until tensor parallelism across processes lands, a leader's stand-in
is a one-rank worker, and a follower's death is what the platform sees of it, a container restart
(restartCount 1, as the kubelet writes it). ProcessGroup acts as the kubelet for the leader that the
LWS controller deletes: SIGTERM, and the worker's own drain hands its streams to the other group.
"""

from __future__ import annotations

import openai
import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.completion_streams import CompletionStreams, undisturbed
from tandem.testing.kube_nodes import GPU_TOLERATION, POOL_LABEL
from tandem.testing.pod_workers import ready_pods

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.e2e]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
STREAMS = 6
PROMPTS = [f"Prompt {i}: a rank dies while the answers keep coming." for i in range(3)]
MAX_TOKENS = 600
TOKENS_BEFORE = 8


def spec(model: str) -> dict:
    return {
        "model": {"path": model, "dtype": "float32", "maxModelLen": 1024},
        "prefill": {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}},
        "decode": {"replicas": 2, "gpus": 1, "cpu": "100m", "memory": "1Gi",
                   "parallelism": {"tensor": 2, "nodes": 2},
                   "nodeSelector": {POOL_LABEL: "decode"}, "tolerations": [dict(GPU_TOLERATION)]},
        "kvTransfer": {"backend": "tcp"},
        "router": {"cpu": "50m", "memory": "128Mi", "policy": "round-robin"},
    }


def _leaders(api, ns: str, name: str) -> dict[str, dict]:
    """Ready decode leaders by group index."""
    return {p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/group-index"]: p
            for p in ready_pods(api, ns, name, "decode") if p["metadata"]["labels"]["tandem.dev/group-member"] == "leader"}


def _restart_container(api, pod) -> None:
    """What the kubelet reports after a container's process died and it started it again."""
    statuses = api.sanitize_for_serialization(pod.status.container_statuses)
    for s in statuses:
        s["restartCount"] = 1
        s["lastState"] = {"terminated": {"exitCode": 137, "reason": "Error",
                                         "startedAt": s["state"]["running"]["startedAt"],
                                         "finishedAt": s["state"]["running"]["startedAt"]}}
    client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace,
                                                      {"status": {"containerStatuses": statuses}})


def _ready(api, ns: str, name: str) -> bool:
    tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], ns, GVP[2], name)
    ready = next((c for c in tis.get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})
    return ready.get("status") == "True" and tis["status"]["decode"]["summary"] == "2/2"


def test_a_killed_follower_restarts_its_group_and_no_stream_hangs(
        k8s, start_operator, chart_rbac, namespace, procs, toy_model_dir):
    api = procs.api
    start_operator(kubeconfig=chart_rbac().kubeconfig)
    name = "tp"
    crds = client.CustomObjectsApi(api)
    crds.create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
        "spec": spec(str(toy_model_dir))})
    procs.follow_deletions(namespace)
    leaders = wait_until(lambda: len(ls := _leaders(api, namespace, name)) == 2 and ls, timeout=120,
                         what="two ready decode group leaders")
    prefill = wait_until(lambda: ready_pods(api, namespace, name, "prefill") or None, timeout=60, what="prefill")[0]
    workers = [procs.worker_for_pod(p, toy_model_dir) for p in (prefill, *leaders.values())]
    procs.wait_ready(workers)
    router = procs.router(namespace, name, _free_port(), k8s.kubeconfig)
    procs.wait_ready([router])
    wait_until(lambda: router.metric('tandem_router_workers{ready="true",role="decode"}') == 2, timeout=60,
               what="the router seeing both group leaders (and no follower)")
    assert router.metric('tandem_router_workers{ready="false",role="decode"}') == 0, "followers are no workers"

    model = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300).models.list().data[0].id
    expected = undisturbed(router.url, model, PROMPTS, MAX_TOKENS)
    streams = CompletionStreams(router.url, model, [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)], MAX_TOKENS)
    streams.wait(lambda: min(streams.chunks) >= TOKENS_BEFORE, 120, "every stream's first tokens")

    core = client.CoreV1Api(api)
    old_leader = leaders["1"]
    follower = next(p for p in core.list_namespaced_pod(
        namespace, label_selector="tandem.dev/role=decode,leaderworkerset.sigs.k8s.io/group-index=1").items
        if p.metadata.labels["tandem.dev/group-member"] == "follower")
    _restart_container(api, follower)
    # The LWS controller deletes the group's leader; its worker (SIGTERM) hands its streams over.
    wait_until(lambda: old_leader["metadata"]["name"] in procs.terminated or None, timeout=60,
               what="the group's leader deleted (its worker got SIGTERM)")
    streams.join(300)  # no stream hangs or fails: each ends by max_tokens with the undisturbed text
    for i, text in enumerate(streams.texts):
        assert text == expected[i % len(PROMPTS)], f"stream {i} differs from the undisturbed run"

    # The whole group came back: a new leader (new uid) and a new follower, Ready with its stand-in.
    def recreated() -> dict | None:
        leader = _leaders(api, namespace, name).get("1")
        return leader if leader and leader["metadata"]["uid"] != old_leader["metadata"]["uid"] else None

    new = wait_until(recreated, timeout=120, what="group 1 recreated")
    followers = [p for p in core.list_namespaced_pod(
        namespace, label_selector="tandem.dev/role=decode,leaderworkerset.sigs.k8s.io/group-index=1").items
        if not p.metadata.deletion_timestamp and p.metadata.labels["tandem.dev/group-member"] == "follower"]
    assert [f.metadata.uid for f in followers] != [follower.metadata.uid], "the follower was recreated too"
    procs.wait_ready([procs.worker_for_pod(new, toy_model_dir)])
    wait_until(lambda: _ready(api, namespace, name), timeout=60, what="Ready with both groups again")
    again = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    assert again.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0).choices[0].text


def _free_port() -> int:
    from tandem.worker.local.processes import free_port

    return free_port()
