"""The operator probes and scrapes only the pods its own Deployments' ReplicaSets control (issue 21.2).

A pod copied with the service's labels (anyone who may create pods in the namespace can) is neither
probed for KVTransferReady nor scraped by the planner: on the real control plane, a bare pod with the
decode labels runs next to the service's own decode pod, both with an HTTP server at their pod IP
(KWOK gives loopback IPs), and only the service's pod is ever asked.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from tandem.contracts.kv_health import KVHealth
from tandem.operator.probe import HEALTH_PATH
from tandem.testing.cluster import wait_until
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_http import PodHTTP
from tandem.testing.pod_workers import ready_pods

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def health(healthy: bool) -> bytes:
    return json.dumps(KVHealth(backend="tcp", healthy=healthy, last_error="impostor").to_dict()).encode()


def test_a_pod_with_copied_labels_is_never_probed(k8s, api, start_operator, namespace):
    start_operator("--resync-seconds", "1", "--kv-probe-timeout-seconds", "1")
    name = "owned"
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role),
                     "kvTransfer": {"backend": "tcp"}}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)
    (decode,) = wait_until(lambda: ready_pods(api, namespace, name, "decode") or None, timeout=60,
                           what="the service's decode pod")
    labels = dict(decode["metadata"]["labels"])
    labels.pop("pod-template-hash", None)
    impostor = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "impostor", "labels": labels},
                "spec": {"nodeSelector": {POOL_LABEL: "cpu"},
                         "containers": [{"name": "worker", "image": "evil", "ports": [
                             {"name": "http", "containerPort": 8000, "protocol": "TCP"}]}]}}
    client.CoreV1Api(api).create_namespaced_pod(namespace, impostor)
    evil = wait_until(lambda: [p for p in ready_pods(api, namespace, name, "decode")
                               if p["metadata"]["name"] == "impostor"] or None,
                      timeout=60, what="the impostor pod Ready")[0]
    servers = [PodHTTP(decode["status"]["podIP"], 8000, {HEALTH_PATH: health(True)}),
               PodHTTP(evil["status"]["podIP"], 8000, {HEALTH_PATH: health(False)})]
    try:
        own, fake = servers
        wait_until(lambda: len(own.hits) >= 3, timeout=60, what="three KV probes of the service's own pod")
        assert fake.hits == [], f"the operator asked a pod it does not own: {fake.hits}"
        tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
        kv = next(c for c in tis["status"]["conditions"] if c["type"] == "KVTransferReady")
        assert "impostor" not in kv["message"] and kv["reason"] != "TransferFailing", kv
        assert tis["status"]["decode"]["readyReplicas"] == 1
    finally:
        for s in servers:
            s.close()
