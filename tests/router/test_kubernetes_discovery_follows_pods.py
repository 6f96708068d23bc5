"""Discovery in a cluster: the router's view follows the pods of the service's own Deployments as
they appear, turn ready and go away; pods that only carry the labels get no traffic; a watch that
stalls is noticed and replaced by a relist.

Against the real test control plane (kube-apiserver, controller-manager, scheduler, KWOK on fake
nodes): an InferenceService (the CRD applied, no operator running) owns Deployments the test
creates as the operator renders them. Pod IPs are KWOK's fake ones, so this checks the discovery
view, not HTTP to the pods.
"""

from __future__ import annotations

import asyncio
import copy
import socket
import threading
import time
from pathlib import Path

import pytest
import yaml
from tandem.router.discovery.kubernetes import KubernetesDiscovery
from tandem.router.workers import Target

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crd(k8s) -> None:
    k8s.apply_crd(ROOT / "crds" / "inferenceservices.tandem.dev.yaml", "inferenceservices.tandem.dev")


def inference_service(api, namespace: str, name: str) -> dict:
    """An InferenceService (the CPU example's spec) and the ownerReference its children carry."""
    from kubernetes import client

    body = yaml.safe_load((ROOT / "examples" / "cpu.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": namespace}
    created = client.CustomObjectsApi(api).create_namespaced_custom_object(
        "tandem.dev", "v1alpha1", namespace, "inferenceservices", body)
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "name": name,
            "uid": created["metadata"]["uid"], "controller": True}


def _template(service: str, role: str, kv_compat: str) -> dict:
    labels = {"tandem.dev/service": service, "tandem.dev/role": role, "tandem.dev/kv-compat": kv_compat}
    return {
        "metadata": {"labels": labels},
        "spec": {
            "nodeSelector": {"tandem.dev/pool": "cpu"},
            "containers": [{"name": "worker", "image": "tandem-worker:test",
                            "ports": [{"name": "http", "containerPort": 8123}]}],
        },
    }


def deployment(api, namespace: str, name: str, role: str, owner: dict | None, service: str = "svc",
               kv_compat: str = "g1", replicas: int = 1) -> None:
    from kubernetes import client

    template = _template(service, role, kv_compat)
    meta: dict = {"name": name, "labels": template["metadata"]["labels"]}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    client.AppsV1Api(api).create_namespaced_deployment(namespace, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": template | {"metadata": {"labels": template["metadata"]["labels"] | {"app": name}}}},
    })


def scale(api, namespace: str, name: str, replicas: int) -> None:
    from kubernetes import client

    client.AppsV1Api(api).patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": replicas}})


def bare_pod(api, namespace: str, name: str, role: str, service: str = "svc") -> None:
    from kubernetes import client

    t = _template(service, role, "g1")
    client.CoreV1Api(api).create_namespaced_pod(namespace, {"apiVersion": "v1", "kind": "Pod",
                                                            "metadata": {"name": name} | t["metadata"],
                                                            "spec": t["spec"]})


async def _until(view, predicate, what: str, timeout_s: float = 90) -> list[Target]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if view and predicate(view[-1]):
            return view[-1]
        await asyncio.sleep(0.1)
    raise AssertionError(f"discovery never saw {what}; last view: {view[-1] if view else None}")


def _by_role(targets: list[Target], role: str) -> list[Target]:
    return [t for t in targets if t.role is not None and t.role.value == role]


def _running_pods(api, namespace: str, **labels: str) -> list:
    from kubernetes import client

    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    return [p for p in pods if p.status.phase == "Running" and p.status.pod_ip]


async def test_discovery_follows_the_service_s_deployments(k8s, crd, namespace):
    views: list[list[Target]] = []
    with k8s.api_client() as api:
        owner = inference_service(api, namespace, "svc")
        deployment(api, namespace, "svc-prefill", "prefill", owner)
        deployment(api, namespace, "svc-decode", "decode", owner)
        disc = KubernetesDiscovery(api, namespace, "svc", views.append, default_port=9999, watch_timeout_s=5)
        disc.start(asyncio.get_running_loop())
        try:
            view = await _until(views, lambda v: len(v) == 2 and all(t.ready for t in v), "two ready workers")
            assert {t.role.value for t in view} == {"prefill", "decode"}
            assert all(t.kv_compat == "g1" and t.url.endswith(":8123") for t in view)
            (pod,) = _running_pods(api, namespace, **{"tandem.dev/role": "decode"})
            assert _by_role(view, "decode")[0].url == f"http://{pod.status.pod_ip}:8123"

            # a new kv_compat of decode (a rollout), then the old one scaled away
            deployment(api, namespace, "svc-decode-g2", "decode", owner, kv_compat="g2")
            view = await _until(views, lambda v: len(_by_role(v, "decode")) == 2 and all(t.ready for t in v),
                                "the g2 decode worker")
            assert sorted(t.kv_compat for t in _by_role(view, "decode")) == ["g1", "g2"]
            scale(api, namespace, "svc-decode", 0)
            view = await _until(views, lambda v: len(_by_role(v, "decode")) == 1, "the g1 decode pod gone")
            assert _by_role(view, "decode")[0].kv_compat == "g2" and len(_by_role(view, "prefill")) == 1
        finally:
            disc.stop()


async def test_pods_that_only_carry_the_labels_get_no_traffic(k8s, crd, namespace):
    """A bare pod, a Deployment nobody owns and one owned by another InferenceService, all with the
    service's labels and all Running: discovery shows only the service's own Deployment's pod."""
    views: list[list[Target]] = []
    with k8s.api_client() as api:
        owner = inference_service(api, namespace, "svc")
        other = inference_service(api, namespace, "other")
        bare_pod(api, namespace, "rogue", "decode")
        deployment(api, namespace, "unowned", "decode", None)
        deployment(api, namespace, "other-decode", "decode", other)
        deployment(api, namespace, "svc-decode", "decode", owner)
        deadline = time.monotonic() + 90
        while len(_running_pods(api, namespace, **{"tandem.dev/service": "svc"})) < 4:
            assert time.monotonic() < deadline, "the four look-alike pods never ran"
            await asyncio.sleep(0.2)
        disc = KubernetesDiscovery(api, namespace, "svc", views.append, default_port=9999, watch_timeout_s=5)
        disc.start(asyncio.get_running_loop())
        try:
            view = await _until(views, lambda v: len(v) == 1 and v[0].ready, "the service's own decode pod")
            (own,) = _running_pods(api, namespace, app="svc-decode")
            assert view[0].url == f"http://{own.status.pod_ip}:8123"
            # a later look-alike is refused too (the watch path, not only the list)
            bare_pod(api, namespace, "rogue-2", "decode")
            scale(api, namespace, "svc-decode", 2)
            view = await _until(views, lambda v: len(v) == 2 and all(t.ready for t in v), "the second own pod")
            own_ips = {p.status.pod_ip for p in _running_pods(api, namespace, app="svc-decode")}
            assert {t.url for t in view} == {f"http://{ip}:8123" for ip in own_ips}
        finally:
            disc.stop()


async def test_router_app_tracks_discovered_pods(k8s, crd, namespace):
    """The whole router with Kubernetes discovery: its pool follows the Deployment's pods (unreachable
    fake IPs count as known but not ready, so /ready stays 503)."""
    import aiohttp
    from aiohttp.test_utils import TestServer
    from tandem.router.app import build_app
    from tandem.router.config import RouterConfig

    config = RouterConfig(kubernetes=True, namespace=namespace, service="svc", poll_interval_s=0.5,
                          connect_timeout_s=0.5)
    with k8s.api_client() as api:
        owner = inference_service(api, namespace, "svc")
        disc = KubernetesDiscovery(api, namespace, "svc", lambda t: None, watch_timeout_s=5)
        server = TestServer(build_app(config, disc), host="127.0.0.1")
        await server.start_server()
        base = f"http://127.0.0.1:{server.port}"

        async def until_total(session: aiohttp.ClientSession, want: int) -> None:
            deadline = time.monotonic() + 90
            while True:
                async with session.get(base + "/ready") as r:
                    assert r.status == 503
                    if (await r.json())["workers"]["decode"]["total"] == want:
                        return
                assert time.monotonic() < deadline, f"router never saw {want} decode workers"
                await asyncio.sleep(0.2)

        try:
            async with aiohttp.ClientSession() as session:
                await until_total(session, 0)
                deployment(api, namespace, "svc-decode", "decode", owner)
                await until_total(session, 1)
                scale(api, namespace, "svc-decode", 0)
                await until_total(session, 0)
        finally:
            await server.close()


class FreezingProxy:
    """A TCP relay to the API server whose open connections can be frozen (bytes stop, sockets stay
    open), as a dead load balancer or a half-open connection leaves a watch; new ones still pass."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.frozen: list[threading.Event] = []
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client_sock, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            freeze = threading.Event()
            self.frozen.append(freeze)
            self.sockets += [client_sock, upstream]
            for a, b in ((client_sock, upstream), (upstream, client_sock)):
                threading.Thread(target=self._pump, args=(a, b, freeze), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, freeze: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                if freeze.is_set():
                    freeze.wait()  # frozen for good: hold the bytes, keep the sockets open
                    return
                dst.sendall(data)
        except OSError:
            return

    def freeze_open_connections(self) -> None:
        for f in self.frozen:
            f.set()

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


async def test_a_stalled_watch_is_replaced_by_a_relist(k8s, crd, namespace):
    from urllib.parse import urlsplit

    from kubernetes import client

    views: list[list[Target]] = []
    with k8s.api_client() as api:
        owner = inference_service(api, namespace, "svc")
        deployment(api, namespace, "svc-decode", "decode", owner)
        server = urlsplit(api.configuration.host)
        proxy = FreezingProxy((server.hostname, server.port))
        config = copy.copy(api.configuration)
        config.host = f"https://{server.hostname}:{proxy.port}"
        config.refresh_api_key_hook = None  # the kubeconfig loader's hook would set the host back
        proxied = client.ApiClient(config)
        # the server ends each watch after 3 s; silence 2 s past that is a stall
        disc = KubernetesDiscovery(proxied, namespace, "svc", views.append, default_port=9999,
                                   watch_timeout_s=3, watch_stall_s=2, request_timeout_s=3)
        disc.start(asyncio.get_running_loop())
        try:
            await _until(views, lambda v: len(v) == 1 and v[0].ready, "the decode pod")
            proxy.freeze_open_connections()  # the watch in flight hears nothing more, ever
            scale(api, namespace, "svc-decode", 2)
            await _until(views, lambda v: len(v) == 2 and all(t.ready for t in v),
                         "the second pod, through a fresh list after the stall")
        finally:
            disc.stop()
            proxy.close()
            proxied.close()
