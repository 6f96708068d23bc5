"""Kubernetes discovery: watch the service's worker pods and follow readiness, scaling and restarts.

Pods are selected by `tandem.dev/service=<service>`; `tandem.dev/role` says prefill, decode or
colocated and `tandem.dev/kv-compat` which pods may be paired. A pod counts as ready when its
Ready condition is True, it has an IP and is not being deleted.

Labels prove nothing (anyone who can create a pod can copy them), so a pod gets traffic only when
its controller chain leads to the InferenceService: pod -> ReplicaSet -> Deployment -> the
InferenceService named `service`, or, for a worker whose tensor-parallel group spans nodes, pod ->
StatefulSet -> LeaderWorkerSet -> the InferenceService (only a group's leader pod takes requests:
followers are labelled tandem.dev/group-member=follower), each link a controller ownerReference
whose uid matches the object read back from the API server. Verdicts are cached per ReplicaSet or
StatefulSet uid until the next relist.

Every call has a timeout: a list or a connect `request_timeout_s`; a watch asks the server to end
it after `watch_timeout_s` and gives up on a connection silent for `watch_stall_s` more (a dead
load balancer, a half-open TCP connection), then relists. The `kubernetes` client is synchronous,
so the loop runs in a daemon thread and hands whole snapshots to the event loop. RBAC: `get, list,
watch` on pods, `get` on apps/replicasets, apps/deployments, apps/statefulsets and
leaderworkerset.x-k8s.io/leaderworkersets, in its namespace.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from tandem.contracts.names import (
    LABEL_KV_COMPAT,
    LABEL_ROLE,
    LABEL_SERVICE,
    Role,
    controller_ref,
    pod_ready,
    pod_url,
    serves_requests,
)
from tandem.router.worker_client import describe
from tandem.router.workers import Target

log = logging.getLogger("tandem.router.discovery")

Getter = Callable[[str], "dict[str, Any] | None"]  # name -> the object as a JSON dict, None if absent


def _owner(obj: dict[str, Any], kind: str, group: str, get: Getter) -> dict[str, Any] | None:
    """The controller of `obj` of that kind, read back and checked to be the very object (uid)."""
    ref = controller_ref(obj, kind, group)
    if ref is None or not ref.get("name"):
        return None
    owner = get(ref["name"])
    if owner is None or (owner.get("metadata") or {}).get("uid") != ref.get("uid"):
        return None
    return owner


LWS_GROUP = "leaderworkerset.x-k8s.io"
# A pod's controller (kind, API group) -> the kind and group of the workload that controls it.
WORKLOAD_OF = {("ReplicaSet", "apps"): ("Deployment", "apps"),
               ("StatefulSet", "apps"): ("LeaderWorkerSet", LWS_GROUP)}


def owned_by_service(replica_set: dict[str, Any], service: str, get_deployment: Getter,
                     workload: tuple[str, str] = ("Deployment", "apps")) -> bool:
    """Whether a ReplicaSet (or a group's StatefulSet) belongs to a Deployment (or LeaderWorkerSet:
    `workload` says which) that the InferenceService `service` controls."""
    owner = _owner(replica_set, *workload, get_deployment)
    if owner is None:
        return False
    ref = controller_ref(owner, "InferenceService", "tandem.dev")
    return ref is not None and ref.get("name") == service


def pod_target(pod: dict[str, Any], default_port: int) -> Target | None:
    """The worker a pod (as a JSON dict) stands for, or None if it is not a worker pod."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        role = Role(labels.get(LABEL_ROLE, ""))
    except ValueError:
        return None  # e.g. the router's own pods
    if not serves_requests(pod):
        return None  # a group's follower: its ranks run behind the leader's HTTP API
    url = pod_url(pod, default_port)
    if url is None:
        return None
    return Target(url=url, role=role, kv_compat=labels.get(LABEL_KV_COMPAT, ""), ready=pod_ready(pod))


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
        request_timeout_s: float = 10.0,
        watch_stall_s: float = 30.0,
    ) -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.service = service
        self.on_change = on_change
        self.default_port = default_port
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.watch_stall_s = watch_stall_s
        self._trusted_rs: dict[str, bool] = {}  # ReplicaSet uid -> owned by the service
        self._ignored: set[str] = set()  # untrusted pods already logged
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tandem-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _readers(self, apps: Any) -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
        """Per pod controller kind: how to read it, and how to read the workload that controls it."""
        from kubernetes import client

        def read_lws(name: str, namespace: str, **kwargs: Any) -> Any:
            return client.CustomObjectsApi(self.api_client).get_namespaced_custom_object(
                LWS_GROUP, "v1", namespace, "leaderworkersets", name, **kwargs)

        return {"ReplicaSet": (apps.read_namespaced_replica_set, apps.read_namespaced_deployment),
                "StatefulSet": (apps.read_namespaced_stateful_set, read_lws)}

    def _trusted(self, pod: dict[str, Any], apps: Any) -> bool:
        """Whether the pod's controller chain leads to the InferenceService (see the module doc)."""
        kind, ref = next(((k, r) for k, g in WORKLOAD_OF if (r := controller_ref(pod, k, g)) is not None),
                         (None, None))
        uid = ref.get("uid") if ref is not None else None
        if kind and uid and uid not in self._trusted_rs:
            read, read_workload = self._readers(apps)[kind]
            owner = self._get(read, ref.get("name", ""))
            self._trusted_rs[uid] = owner is not None and (owner.get("metadata") or {}).get("uid") == uid and (
                owned_by_service(owner, self.service, lambda name: self._get(read_workload, name),
                                 WORKLOAD_OF[(kind, "apps")]))
        ok = bool(uid) and self._trusted_rs[uid]
        name = (pod.get("metadata") or {}).get("name")
        if not ok and name not in self._ignored:
            self._ignored.add(name)
            log.warning("pod %s carries the labels of %s but is not a pod of its Deployments: ignored",
                        name, self.service)
        return ok

    def _get(self, read: Callable[..., Any], name: str) -> dict[str, Any] | None:
        """One object as a JSON dict; None when it does not exist (other API errors propagate)."""
        from kubernetes.client.rest import ApiException

        try:
            obj = read(name, self.namespace, _request_timeout=self.request_timeout_s)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.api_client.sanitize_for_serialization(obj)

    def _publish(self, pods: dict[str, dict[str, Any]], apps: Any) -> None:
        trusted = {name: pod for name, pod in pods.items() if self._trusted(pod, apps)}
        targets = snapshot_targets(trusted, self.default_port)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self.on_change, targets)
        except RuntimeError:  # loop closed: we are shutting down
            self._stop.set()

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.rest import ApiException

        core = client.CoreV1Api(self.api_client)
        apps = client.AppsV1Api(self.api_client)
        selector = f"{LABEL_SERVICE}={self.service}"
        sanitize = self.api_client.sanitize_for_serialization
        while not self._stop.is_set():
            try:
                listed = core.list_namespaced_pod(self.namespace, label_selector=selector,
                                                  _request_timeout=self.request_timeout_s)
                pods = {p.metadata.name: sanitize(p) for p in listed.items}
                rv = listed.metadata.resource_version
                self._trusted_rs.clear()  # ownership is read afresh after every relist
                self._publish(pods, apps)
                while not self._stop.is_set():
                    w = watch.Watch()
                    for ev in w.stream(
                        core.list_namespaced_pod,
                        self.namespace,
                        label_selector=selector,
                        resource_version=rv,
                        timeout_seconds=self.watch_timeout_s,
                        allow_watch_bookmarks=True,
                        # a connection silent past the server's own end of the watch is stalled
                        _request_timeout=(self.request_timeout_s, self.watch_timeout_s + self.watch_stall_s),
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
                        self._publish(pods, apps)
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: our resourceVersion is too old, relist
                    log.warning("pod watch failed: %s; relisting", exc.reason)
                    self._stop.wait(1.0)
            except Exception as exc:  # the API server restarting, a dropped connection
                log.warning("pod watch failed: %s; relisting", describe(exc))  # never a repr: see describe
                self._stop.wait(1.0)
