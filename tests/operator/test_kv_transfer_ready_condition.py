"""KVTransferReady on the real control plane, with real workers standing in for the pods.

The scheduler places the InferenceService's pods on KWOK nodes, KWOK gives them loopback IPs, and
a real `tandem worker` runs at each worker pod's IP and rendered port, a real `tandem router
--kubernetes` at the router pod's: it finds the workers through the API server, polls their
/internal/info (which carries their KV health) and serves a streaming chat request that hands KV
from prefill to decode over TCP. The operator (a subprocess) reads the router's report for
KVTransferReady, never the workers themselves.
"""

from __future__ import annotations

import re

import openai
import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_workers import ready_pods

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.e2e]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def _role(pool: str, gpus: int = 0) -> dict:
    role = {"replicas": 1, "gpus": gpus, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: pool}}
    if gpus:
        role["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return role


def cpu_tcp_spec(model: str) -> dict:
    """examples/cpu.yaml, scaled down, with the toy model: KV over TCP."""
    return {
        "model": {"path": model, "dtype": "float32", "maxModelLen": 512},
        "prefill": _role("cpu"), "decode": _role("cpu"),
        "kvTransfer": {"backend": "tcp"},
        "router": {"cpu": "50m", "memory": "128Mi"},
    }


def gpu_roce_spec(model: str) -> dict:
    """examples/gpu-roce.yaml reduced to one worker per role: nixl with kvTransfer.rdma set."""
    return {
        "model": {"path": model, "dtype": "float32", "maxModelLen": 512},
        "prefill": _role("prefill", gpus=1), "decode": _role("decode", gpus=1),
        "kvTransfer": {"backend": "nixl", "rdma": {"resourceName": "rdma/rdma_shared_device_a", "count": 1}},
        "router": {"cpu": "50m", "memory": "128Mi"},
    }


@pytest.fixture(scope="module")
def operator(start_operator):
    return start_operator("--resync-seconds", "1", "--kv-probe-timeout-seconds", "2")


def apply_service(api, namespace: str, name: str, spec: dict) -> None:
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": spec}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)


def worker_pods(api, namespace: str, name: str) -> dict[str, dict]:
    """role -> the one Ready worker pod with an IP (waits until both roles have one)."""
    def found():
        pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"tandem.dev/service={name}")
        out = {}
        for pod in api.sanitize_for_serialization(pods.items):
            role = pod["metadata"]["labels"].get("tandem.dev/role")
            ready = any(c["type"] == "Ready" and c["status"] == "True"
                        for c in pod["status"].get("conditions") or [])
            if role in ("prefill", "decode") and ready and pod["status"].get("podIP"):
                out[role] = pod
        return out if len(out) == 2 else None

    return wait_until(found, timeout=60, what=f"{name}'s prefill and decode pods Ready with an IP")


def router_pod(api, namespace: str, name: str) -> dict:
    return wait_until(lambda: ready_pods(api, namespace, name, "router") or None, timeout=60,
                      what=f"{name}'s router pod Ready")[0]


def kv_condition(api, namespace: str, name: str) -> dict:
    tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
    conditions = (tis.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "KVTransferReady"), {})


def wait_kv(api, namespace: str, name: str, status: str, reason: str, timeout: float = 30,
            naming: tuple[str, ...] = ()) -> dict:
    """Until KVTransferReady has this status and reason, and its message names every pod in
    `naming`: workers become ready one at a time, so the condition first names those probed so far."""
    last: dict = {}

    def check():
        nonlocal last
        last = kv_condition(api, namespace, name)
        found = (last.get("status"), last.get("reason")) == (status, reason)
        return last if found and all(n in last.get("message", "") for n in naming) else None

    try:
        return wait_until(check, timeout=timeout, what=f"KVTransferReady {status}/{reason}")
    except TimeoutError:
        raise AssertionError(f"KVTransferReady never became {status}/{reason} naming {naming}; "
                             f"last: {last}") from None


def test_tcp_workers_are_healthy_serve_through_the_router_and_a_dead_one_is_unreachable(
    k8s, api, operator, namespace, procs, toy_model_dir
):
    name = "tiny"
    apply_service(api, namespace, name, cpu_tcp_spec(str(toy_model_dir)))
    pods = worker_pods(api, namespace, name)
    prefix = k8s.pod_cidr.rsplit(".", 2)[0] + "."
    assert all(p["status"]["podIP"].startswith(prefix) for p in pods.values()), k8s.pod_cidr
    workers = {role: procs.worker_for_pod(pod, toy_model_dir) for role, pod in pods.items()}
    procs.wait_ready(list(workers.values()))
    c = wait_kv(api, namespace, name, "Unknown", "Unreachable",
                naming=tuple(p["metadata"]["name"] for p in pods.values()))
    assert "no router has polled it yet" in c["message"] or "no router report names it" in c["message"], c

    router = procs.router_for_pod(router_pod(api, namespace, name), k8s.kubeconfig)
    procs.wait_ready([router])
    c = wait_kv(api, namespace, name, "True", "Healthy")
    # (and, once the router's parity probe has handed KV off, what that transfer measured)
    assert c["message"].split("; ")[0] == "2 workers report tcp over tcp", c
    oai = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = oai.models.list().data[0].id
    stream = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello to the cluster."}],
        max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
    )
    finish, usage, text = None, None, ""
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert finish in ("stop", "length") and usage is not None and usage.completion_tokens > 0, (text, usage)
    metrics = workers["decode"].get_text("/metrics")
    pulled = [float(v) for v in re.findall(r'^tandem_kv_transfer_bytes_total\{[^}]*\} (\S+)$', metrics, re.M)]
    assert sum(pulled) > 0, metrics

    workers["decode"].kill()
    c = wait_kv(api, namespace, name, "Unknown", "Unreachable", timeout=10)
    assert pods["decode"]["metadata"]["name"] in c["message"] and "its router cannot reach it" in c["message"], c
    assert pods["prefill"]["metadata"]["name"] not in c["message"]


def test_rdma_spec_served_over_tcp_is_an_rdma_fallback_with_a_warning(
    k8s, api, operator, namespace, procs, toy_model_dir
):
    name = "roce"
    apply_service(api, namespace, name, gpu_roce_spec(str(toy_model_dir)))
    pods = worker_pods(api, namespace, name)
    # The workers cannot reach RDMA (no device here): they move KV over TCP.
    workers = [procs.worker_for_pod(pod, toy_model_dir, kv_backend="tcp") for pod in pods.values()]
    workers.append(procs.router_for_pod(router_pod(api, namespace, name), k8s.kubeconfig))
    procs.wait_ready(workers)

    c = wait_kv(api, namespace, name, "False", "RDMAFallback",
                naming=tuple(pod["metadata"]["name"] for pod in pods.values()))
    assert "never uses RDMA" in c["message"]

    events = wait_events(api, namespace, name, lambda e: e.reason == "RDMAFallback" and e.type == "Warning",
                         "a Warning event RDMAFallback")
    assert len(events) == 1 and (events[0].count or 1) == 1, "one event per transition, not per resync"
