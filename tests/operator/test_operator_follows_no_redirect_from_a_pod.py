"""A pod that answers the operator's KV health probe with a redirect moves nothing (issue 28 item 8), on
the real control plane with the operator under the chart's RBAC. KWOK gives the service's pods
loopback IPs; plain HTTP servers stand in for them: prefill answers healthy, decode answers 302 to
another local server that would answer healthy too. KVTransferReady says the decode pod redirected
and the operator did not follow, it never turns True on the redirect target's word, and the target is
never asked anything."""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import pod_port
from tandem.operator.probe import HEALTH_PATH
from tandem.testing.cluster import free_port, wait_until
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_http import PodHTTP
from tandem.testing.pod_workers import ready_pods
from tandem.testing.rbac import rbac_denials

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
HEALTHY = {HEALTH_PATH: json.dumps(KVHealth(backend="tcp", healthy=True).to_dict()).encode()}


def _kv_condition(api, namespace: str, name: str) -> dict:
    tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
    return next((c for c in (tis.get("status") or {}).get("conditions") or [] if c["type"] == "KVTransferReady"), {})


def test_a_redirecting_worker_is_unreachable_and_its_target_never_asked(api, start_operator, chart_rbac, namespace):
    operator = start_operator("--resync-seconds", "1", "--kv-probe-timeout-seconds", "1",
                              kubeconfig=chart_rbac().kubeconfig)
    name = "redirects"
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "256Mi", "nodeSelector": {POOL_LABEL: "cpu"}}
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role),
                     "kvTransfer": {"backend": "tcp"}}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)
    pods = {r: wait_until(lambda r=r: ready_pods(api, namespace, name, r) or None, timeout=60,
                          what=f"the {r} pod Ready")[0] for r in ("prefill", "decode")}
    at = {r: (p["status"]["podIP"], pod_port(p)) for r, p in pods.items()}  # where the pod's worker would listen
    target = PodHTTP("127.0.0.1", free_port(), HEALTHY)
    servers = [target]
    try:
        servers.append(prefill := PodHTTP(*at["prefill"], HEALTHY))
        servers.append(decode := PodHTTP(*at["decode"], {},
                                         redirect_to=f"http://127.0.0.1:{target.server.server_port}"))

        def settled() -> dict | None:
            c = _kv_condition(api, namespace, name)
            if c.get("status") == "True":
                return c  # what following the redirect gives: stop waiting, the asserts below say so
            return c if (c.get("reason") == "Unreachable" and pods["decode"]["metadata"]["name"] in c["message"]
                         and decode.hits.count(HEALTH_PATH) >= 3) else None

        c = wait_until(settled, timeout=60, what="KVTransferReady Unreachable naming the redirecting decode pod, "
                                                 "after three probes of it")
        assert c["status"] != "True", f"True on the redirect target's answer: {c}; target asked {target.hits}"
        assert target.hits == [], f"the operator followed the redirect: {target.hits}"
        assert c["status"] == "Unknown", c
        assert "a redirect, which the operator does not follow" in c["message"], c["message"]
        assert pods["prefill"]["metadata"]["name"] not in c["message"], "prefill answered for itself"
        assert prefill.hits, "the operator probed the healthy pod too"
        assert not rbac_denials(operator.log()), "the chart's RBAC lacks what the operator needs"
    finally:
        for s in servers:
            s.close()
