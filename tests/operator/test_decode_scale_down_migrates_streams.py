"""Scaling decode down on the real control plane while 20 streams run: no stream fails, each has
exactly the text of an undisturbed run. Real worker and router processes stand in for the pods
(KWOK gives them loopback IPs); ProcessGroup acts as the kubelet for a deleted pod (SIGTERM, then
the worker's own drain). The operator runs with the default Helm chart's RBAC: no `pods: patch`
anywhere, so the ReplicaSet picks the pod to remove (issue 21.7) and its streams still move.

The operator lowers decode from 2 to 1 because maxReplicas drops to 1 while the streams run (the
planner's idle scale-down needs the load gone first: test_planner_scales_decode_with_real_workers.py);
the removed pod's worker hands its running sequences to the other decode pod by KV transfer, and the
router carries each stream over.

The streams are held open until the pod is gone, so none can finish first (issue 21.12: on a fresh
machine they once did, and no stream migrated): both decode workers are frozen (SIGSTOP) once every
stream has its first tokens, the scale-down runs while they are frozen (the kubelet's SIGTERM to the
removed one waits, pending), and each stream is checked to be mid-flight before they thaw (SIGCONT):
the survivor first, until the router sees it ready again, then the removed one. The router's chunk
timeout is raised so the frozen workers' silence is not taken for death.
"""

from __future__ import annotations

import os
import signal

import openai
import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.completion_streams import CompletionStreams, undisturbed
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_workers import ready_pods
from tandem.testing.rbac import rbac_denials

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.e2e]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
STREAMS = 20
PROMPTS = [f"Prompt {i}: the pool shrinks while the answers keep coming." for i in range(4)]
# The streams are held open by freezing the workers, but only once the last of the 20 has its first
# tokens: the first ones started up to a second earlier (one prefill worker, a queue of 20 prompts)
# and a fresh clone once saw two finish 300 tokens before the last one's first arrived. 800 keeps
# them all mid-flight (the model's context is 1024).
MAX_TOKENS = 800
TOKENS_BEFORE = 8


def spec(model: str) -> dict:
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    return {
        "model": {"path": model, "dtype": "float32", "maxModelLen": 1024},
        "prefill": dict(role), "decode": dict(role),
        "kvTransfer": {"backend": "tcp"},
        "router": {"cpu": "50m", "memory": "128Mi", "policy": "round-robin"},
        "autoscaling": {"intervalSeconds": 5, "windowSeconds": 10,
                        "decode": {"minReplicas": 2, "maxReplicas": 2}},
    }


def test_streams_survive_a_decode_scale_down_by_migrating(
    k8s, start_operator, chart_rbac, namespace, procs, toy_model_dir
):
    api = procs.api
    operator = start_operator(kubeconfig=chart_rbac().kubeconfig)
    name = "shrink"
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": spec(str(toy_model_dir))}
    crds = client.CustomObjectsApi(api)
    crds.create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)
    procs.follow_deletions(namespace)
    decode = wait_until(lambda: len(p := ready_pods(api, namespace, name, "decode")) == 2 and p, timeout=90,
                        what="two Ready decode pods (minReplicas 2)")
    pods = [wait_until(lambda r=r: ready_pods(api, namespace, name, r) or None, timeout=60, what=f"a {r} pod")[0]
            for r in ("prefill", "router")]
    workers = {p["metadata"]["name"]: procs.worker_for_pod(p, toy_model_dir) for p in [pods[0], *decode]}
    procs.wait_ready(workers.values())
    router = procs.router_for_pod(pods[1], k8s.kubeconfig, args=("--chunk-timeout-s", "300"))
    procs.wait_ready([router])
    wait_until(lambda: router.metric('tandem_router_workers{ready="true",role="decode"}') == 2, timeout=30,
               what="the router seeing both decode workers")
    # The router hands KV only to workers its parity probe has proven, one probe at a time: until the
    # second decode worker's probe is done every stream goes to the first (a fresh clone saw that, and
    # the ReplicaSet then removed the idle one: nothing to migrate).
    wait_until(lambda: router.metric('tandem_router_parity_workers{state="verified"}') == 3, timeout=60,
               what="the router's parity probe proving every worker")

    model = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300).models.list().data[0].id
    expected = undisturbed(router.url, model, PROMPTS, MAX_TOKENS)

    streams = CompletionStreams(router.url, model, [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)], MAX_TOKENS)
    streams.wait(lambda: min(streams.chunks) >= TOKENS_BEFORE, 120, "every stream's first tokens")
    frozen = {p["metadata"]["name"]: workers[p["metadata"]["name"]] for p in decode}
    running = {pod: w.metric("tandem_worker_running_sequences") for pod, w in frozen.items()}
    assert all(running.values()), f"either decode pod may be removed, so both must run streams: {running}"
    for w in frozen.values():
        os.kill(w.proc.pid, signal.SIGSTOP)  # no token moves until the pod is gone
    try:
        patch = {"spec": {"autoscaling": {"decode": {"minReplicas": 1, "maxReplicas": 1}}}}
        crds.patch_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name, patch)
        removed = wait_until(lambda: procs.terminated or None, timeout=60, what="a decode pod deleted (SIGTERM)")
        with streams.changed:
            mid_flight = [(i, n, f) for i, (n, f) in enumerate(zip(streams.chunks, streams.finish, strict=True))]
        assert all(f is None and TOKENS_BEFORE <= n < MAX_TOKENS for _, n, f in mid_flight), mid_flight
        # The survivor thaws first, and the router sees it ready again (its health polls failed while it
        # was frozen); then the removed worker thaws, takes its pending SIGTERM and hands its streams over.
        (survivor,) = [w for pod, w in frozen.items() if pod not in removed]
        os.kill(survivor.proc.pid, signal.SIGCONT)
        wait_until(lambda: router.metric('tandem_router_workers{ready="true",role="decode"}') == 1, timeout=60,
                   what="the router seeing the surviving decode worker ready")
    finally:
        for w in frozen.values():
            os.kill(w.proc.pid, signal.SIGCONT)
    streams.join(300)  # every stream ended by max_tokens, none with an error
    for i, text in enumerate(streams.texts):
        assert text == expected[i % len(PROMPTS)], f"stream {i} differs from the undisturbed run"
    assert len(removed) == 1 and removed[0] in workers
    assert workers[removed[0]].proc.wait(60) == 0, workers[removed[0]].log()[-3000:]
    assert router.metric('tandem_router_migrations_total{outcome="kv"}') > 0, router.get_text("/metrics")
    assert router.metric('tandem_router_migrations_total{outcome="failed"}') == 0
    assert not rbac_denials(operator.log()), "the default chart's RBAC lacks what a scale-down does"
