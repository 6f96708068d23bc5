"""A router pod that answers the operator's read of its report with a redirect moves nothing (issue 28
item 8), on the real control plane with the operator under the chart's RBAC. KWOK gives the service's
pods loopback IPs; plain HTTP servers stand in for them. The router pod answers 302 to another local
server whose report would call both workers healthy: KVTransferReady says the router redirected and the
operator did not follow, it never turns True on the redirect target's word, and the target is never
asked anything. The workers themselves are never asked either: their KV health comes from the routers'
reports (issue 32 item 1). Then the router pod answers its own report, and KVTransferReady turns True
on it."""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from tandem.contracts.handoff_parity import PARITY_PATH, ParityReport
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import pod_port, pod_url
from tandem.testing.cluster import free_port, wait_until
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_http import PodHTTP
from tandem.testing.pod_workers import ready_pods
from tandem.testing.rbac import rbac_denials

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def _report(workers: list[dict]) -> dict[str, bytes]:
    """A router's report calling every one of `workers` healthy."""
    health = {pod_url(p): KVHealth(backend="tcp", healthy=True) for p in workers}
    return {PARITY_PATH: json.dumps(ParityReport(enabled=True, kv_health=health).to_dict()).encode()}


def _kv_condition(api, namespace: str, name: str) -> dict:
    tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
    return next((c for c in (tis.get("status") or {}).get("conditions") or [] if c["type"] == "KVTransferReady"), {})


def test_a_redirecting_router_is_unreachable_and_its_target_never_asked(api, start_operator, chart_rbac, namespace):
    operator = start_operator("--resync-seconds", "1", "--kv-probe-timeout-seconds", "1",
                              kubeconfig=chart_rbac().kubeconfig)
    name = "redirects"
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "256Mi", "nodeSelector": {POOL_LABEL: "cpu"}}
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role),
                     "router": {"cpu": "50m", "memory": "128Mi"}, "kvTransfer": {"backend": "tcp"}}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)
    pods = {r: wait_until(lambda r=r: ready_pods(api, namespace, name, r) or None, timeout=60,
                          what=f"the {r} pod Ready")[0] for r in ("prefill", "decode", "router")}
    at = {r: (p["status"]["podIP"], pod_port(p)) for r, p in pods.items()}  # where the pod's server would listen
    workers = [pods["prefill"], pods["decode"]]
    target = PodHTTP("127.0.0.1", free_port(), _report(workers))
    servers = [target]
    try:
        servers += [prefill := PodHTTP(*at["prefill"], {}), decode := PodHTTP(*at["decode"], {})]
        servers.append(router := PodHTTP(*at["router"], {},
                                         redirect_to=f"http://127.0.0.1:{target.server.server_port}"))

        def settled() -> dict | None:
            c = _kv_condition(api, namespace, name)
            if c.get("status") == "True":
                return c  # what following the redirect gives: stop waiting, the asserts below say so
            named = all(p["metadata"]["name"] in c.get("message", "") for p in workers)
            return c if (c.get("reason") == "Unreachable" and named and router.hits.count(PARITY_PATH) >= 3) else None

        c = wait_until(settled, timeout=60, what="KVTransferReady Unreachable naming both workers, "
                                                 "after three reads of the router's report")
        assert c["status"] != "True", f"True on the redirect target's answer: {c}; target asked {target.hits}"
        assert target.hits == [], f"the operator followed the redirect: {target.hits}"
        assert c["status"] == "Unknown", c
        assert "a redirect, which the operator does not follow" in c["message"], c["message"]
        assert prefill.hits == [] and decode.hits == [], "the operator asked the workers themselves"

        router.close()  # the router answers its own report now
        servers.append(honest := PodHTTP(*at["router"], _report(workers)))
        c = wait_until(lambda: (c := _kv_condition(api, namespace, name)).get("status") == "True" and c,
                       timeout=60, what="KVTransferReady True on the router's own report")
        assert (c["reason"], c["message"]) == ("Healthy", "2 workers report tcp over unknown"), c
        assert honest.hits and prefill.hits == [] and decode.hits == []
        assert not rbac_denials(operator.log()), "the chart's RBAC lacks what the operator needs"
    finally:
        for s in servers:
            s.close()
