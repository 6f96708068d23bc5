"""Kubernetes discovery: watch the service's worker pods and follow readiness, scaling and restarts.

Pods are selected by `tandem.dev/service=<service>`; `tandem.dev/role` says prefill, decode or
colocated and `tandem.dev/generation` which pods may be paired. A pod counts as ready when its
Ready condition is True, it has an IP and is not being deleted. The `kubernetes` client is
synchronous, so the list+watch loop runs in a daemon thread and hands whole snapshots to the
event loop. It needs RBAC `get, list, watch` on pods in its namespace.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from tandem.contracts.names import (
    LABEL_GENERATION,
    LABEL_ROLE,
    LABEL_SERVICE,
    Role,
    pod_ready,
    pod_url,
)
from tandem.worker.router.pool import Target

log = logging.getLogger("tandem.router.discovery")

def pod_target(pod: dict[str, Any], default_port: int) -> Target | None:
    """The worker a pod (as a JSON dict) stands for, or None if it is not a worker pod."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        role = Role(labels.get(LABEL_ROLE, ""))
    except ValueError:
        return None  # e.g. the router's own pods
    url = pod_url(pod, default_port)
    if url is None:
        return None
    return Target(url=url, role=role, generation=labels.get(LABEL_GENERATION, ""), ready=pod_ready(pod))


def snapshot_targets(pods: dict[str, dict[str, Any]], default_port: int) -> list[Target]:
    """Targets for a set of pods keyed by name; two pods sharing an IP keep the ready one."""
    by_url: dict[str, Target] = {}
    for pod in pods.values():
        t = pod_target(pod, default_port)
        if t is not None and (t.url not in by_url or t.ready):
            by_url[t.url] = t
    return sorted(by_url.values(), key=lambda t: t.url)


class KubernetesDiscovery:
    """List + watch pods of one service; call `on_change(targets)` on the loop after every change."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        service: str,
        on_change: Callable[[list[Target]], None],
        default_port: int = 8000,
        watch_timeout_s: int = 10,
    ) -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.service = service
        self.on_change = on_change
        self.default_port = default_port
        self.watch_timeout_s = watch_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tandem-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _publish(self, pods: dict[str, dict[str, Any]]) -> None:
        targets = snapshot_targets(pods, self.default_port)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self.on_change, targets)
        except RuntimeError:  # loop closed: we are shutting down
            self._stop.set()

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.rest import ApiException

        core = client.CoreV1Api(self.api_client)
        selector = f"{LABEL_SERVICE}={self.service}"
        sanitize = self.api_client.sanitize_for_serialization
        while not self._stop.is_set():
            try:
                listed = core.list_namespaced_pod(self.namespace, label_selector=selector)
                pods = {p.metadata.name: sanitize(p) for p in listed.items}
                rv = listed.metadata.resource_version
                self._publish(pods)
                while not self._stop.is_set():
                    w = watch.Watch()
                    for ev in w.stream(
                        core.list_namespaced_pod,
                        self.namespace,
                        label_selector=selector,
                        resource_version=rv,
                        timeout_seconds=self.watch_timeout_s,
                        allow_watch_bookmarks=True,
                    ):
                        if self._stop.is_set():
                            w.stop()
                            break
                        obj = ev["object"]
                        rv = obj.metadata.resource_version
                        if ev["type"] == "BOOKMARK":
                            continue
                        name = obj.metadata.name
                        if ev["type"] == "DELETED":
                            pods.pop(name, None)
                        else:
                            pods[name] = sanitize(obj)
                        self._publish(pods)
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: our resourceVersion is too old, relist
                    log.warning("pod watch failed: %s; relisting", exc.reason)
                    self._stop.wait(1.0)
            except Exception as exc:  # the API server restarting, a dropped connection
                log.warning("pod watch failed: %r; relisting", exc)
                self._stop.wait(1.0)
