"""The operator probes and scrapes only the pods its own Deployments' ReplicaSets control (issue 21.2).

A pod copied with the service's labels (anyone who may create pods in the namespace can) is never
asked by the operator, and what others say of it never reaches KVTransferReady: on the real control
plane, a bare pod with the decode labels runs next to the service's own decode pod, each with an HTTP
server at its pod IP (KWOK gives loopback IPs); the router pod's report (the workers' KV health comes
from the routers, issue 32 item 1) calls the service's decode pod healthy and the impostor failing,
as a router that discovered it by its labels would. KVTransferReady believes the report only about
the pods the owner chain names.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from tandem.contracts.handoff_parity import PARITY_PATH, ParityReport
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import pod_port, pod_url
from tandem.testing.cluster import wait_until
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_http import PodHTTP
from tandem.testing.pod_workers import ready_pods

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def health(healthy: bool) -> KVHealth:
    return KVHealth(backend="tcp", healthy=healthy, failures_total={} if healthy else {"pull": 9},
                    last_error=None if healthy else "impostor")


def test_a_pod_with_copied_labels_is_never_asked_nor_believed(k8s, api, start_operator, namespace):
    start_operator("--resync-seconds", "1", "--kv-probe-timeout-seconds", "1")
    name = "owned"
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role),
                     "kvTransfer": {"backend": "tcp"}}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)
    (decode,) = wait_until(lambda: ready_pods(api, namespace, name, "decode") or None, timeout=60,
                           what="the service's decode pod")
    (prefill,) = wait_until(lambda: ready_pods(api, namespace, name, "prefill") or None, timeout=60,
                            what="the service's prefill pod")
    (router,) = wait_until(lambda: ready_pods(api, namespace, name, "router") or None, timeout=60,
                           what="the service's router pod")
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
    report = ParityReport(enabled=True, kv_health={pod_url(prefill): health(True), pod_url(decode): health(True),
                                                   pod_url(evil): health(False)})
    servers = [PodHTTP(decode["status"]["podIP"], 8000, {}), PodHTTP(evil["status"]["podIP"], 8000, {}),
               PodHTTP(router["status"]["podIP"], pod_port(router), {PARITY_PATH: json.dumps(report.to_dict()).encode()})]
    try:
        own, fake, reporter = servers
        last: dict = {}

        def kv_condition() -> dict | None:
            nonlocal last
            tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
            last = next((c for c in (tis.get("status") or {}).get("conditions") or []
                         if c["type"] == "KVTransferReady"), {})
            return last if len(reporter.hits) >= 3 and last.get("reason") in ("Healthy", "TransferFailing") else None

        try:
            kv = wait_until(kv_condition, timeout=60, what="KVTransferReady from three reads of the router's report")
        except TimeoutError:
            raise AssertionError(f"KVTransferReady never judged the report; last: {last}") from None
        assert "impostor" not in kv["message"] and kv["reason"] != "TransferFailing", kv
        assert (kv["status"], kv["message"]) == ("True", "2 workers report tcp over unknown"), kv
        assert fake.hits == [] and own.hits == [], f"the operator asked a worker pod: {fake.hits} {own.hits}"
    finally:
        for s in servers:
            s.close()
