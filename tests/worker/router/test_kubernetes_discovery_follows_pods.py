"""Discovery in a cluster: the router's view follows worker pods appearing, turning ready and going away.

Against the real test control plane (kube-apiserver, scheduler, KWOK on fake nodes). Pod IPs are
KWOK's fake ones, so this checks the discovery view, not HTTP to the pods.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from tandem.worker.router.discovery.kubernetes import KubernetesDiscovery
from tandem.worker.router.pool import Target

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _pod(name: str, role: str, generation: str = "g1", service: str = "svc") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {
            "tandem.dev/service": service, "tandem.dev/role": role, "tandem.dev/generation": generation}},
        "spec": {
            "nodeSelector": {"tandem.dev/pool": "cpu"},
            "containers": [{"name": "worker", "image": "tandem-worker:test",
                            "ports": [{"name": "http", "containerPort": 8123}]}],
        },
    }


async def _until(view, predicate, what: str, timeout_s: float = 60) -> list[Target]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if view and predicate(view[-1]):
            return view[-1]
        await asyncio.sleep(0.1)
    raise AssertionError(f"discovery never saw {what}; last view: {view[-1] if view else None}")


def _by_role(targets: list[Target], role: str) -> list[Target]:
    return [t for t in targets if t.role is not None and t.role.value == role]


async def test_discovery_follows_pods(k8s, namespace):
    from kubernetes import client

    views: list[list[Target]] = []
    with k8s.api_client() as api:
        core = client.CoreV1Api(api)
        # a pod of another service and a pod without a role are never workers of ours
        core.create_namespaced_pod(namespace, _pod("other-svc", "decode", service="other"))
        disc = KubernetesDiscovery(api, namespace, "svc", views.append, default_port=9999, watch_timeout_s=5)
        disc.start(asyncio.get_running_loop())
        try:
            await _until(views, lambda v: v == [], "the empty service")

            core.create_namespaced_pod(namespace, _pod("prefill-a", "prefill"))
            core.create_namespaced_pod(namespace, _pod("decode-a", "decode"))
            view = await _until(
                views, lambda v: len(v) == 2 and all(t.ready for t in v), "two ready workers"
            )
            assert {t.role.value for t in view} == {"prefill", "decode"}
            assert all(t.generation == "g1" and t.url.endswith(":8123") for t in view)
            pods = {p.metadata.name: p for p in core.list_namespaced_pod(namespace).items}
            assert _by_role(view, "decode")[0].url == f"http://{pods['decode-a'].status.pod_ip}:8123"

            # scale decode up, with a pod of a new generation (a rollout)
            core.create_namespaced_pod(namespace, _pod("decode-b", "decode", generation="g2"))
            view = await _until(
                views, lambda v: len(_by_role(v, "decode")) == 2 and all(t.ready for t in v), "decode-b"
            )
            assert sorted(t.generation for t in _by_role(view, "decode")) == ["g1", "g2"]

            # scale down: the deleted pod leaves the view (first not ready while terminating, then gone)
            core.delete_namespaced_pod("decode-a", namespace, grace_period_seconds=0)
            view = await _until(views, lambda v: len(_by_role(v, "decode")) == 1, "decode-a gone")
            assert _by_role(view, "decode")[0].generation == "g2"
            assert len(_by_role(view, "prefill")) == 1
        finally:
            disc.stop()


async def test_router_app_tracks_discovered_pods(k8s, namespace):
    """The whole router with Kubernetes discovery: its pool follows the pods (unreachable fake IPs
    count as known but not ready, so /ready stays 503)."""
    import aiohttp
    from aiohttp.test_utils import TestServer
    from kubernetes import client
    from tandem.worker.router.app import build_app
    from tandem.worker.router.config import RouterConfig

    config = RouterConfig(kubernetes=True, namespace=namespace, service="svc", poll_interval_s=0.5,
                          connect_timeout_s=0.5)
    with k8s.api_client() as api:
        core = client.CoreV1Api(api)
        disc = KubernetesDiscovery(api, namespace, "svc", lambda t: None, watch_timeout_s=5)
        server = TestServer(build_app(config, disc), host="127.0.0.1")
        await server.start_server()
        base = f"http://127.0.0.1:{server.port}"

        async def decode_total(session: aiohttp.ClientSession) -> int:
            async with session.get(base + "/ready") as r:
                assert r.status == 503
                return (await r.json())["workers"]["decode"]["total"]

        async def until_total(session, want: int) -> None:
            deadline = time.monotonic() + 60
            while await decode_total(session) != want:
                assert time.monotonic() < deadline, f"router never saw {want} decode workers"
                await asyncio.sleep(0.2)

        try:
            async with aiohttp.ClientSession() as session:
                assert await decode_total(session) == 0
                core.create_namespaced_pod(namespace, _pod("decode-x", "decode"))
                await until_total(session, 1)
                core.delete_namespaced_pod("decode-x", namespace, grace_period_seconds=0)
                await until_total(session, 0)
        finally:
            await server.close()
