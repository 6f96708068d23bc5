"""Real processes standing in for the pods of the test control plane (KWOK runs no containers).

KWOK gives pods loopback IPs (testing/cluster.py Cluster.pod_cidr), so a `tandem worker` bound to a pod's IP
and its rendered port is reachable exactly where the operator's probe and the router's Kubernetes
discovery look for that pod. Every process is killed for sure by ProcessGroup.stop().
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

from tandem.contracts.internal_auth import SECRET_ENV
from tandem.contracts.names import pod_port, pod_ready
from tandem.worker.local.processes import ManagedProcess, Supervisor

TANDEM = str(Path(sys.executable).parent / "tandem")


class ProcessGroup(Supervisor):
    """Workers for pods and a router, started together and stopped together (even on failure).

    With `api` (an admin ApiClient) a stand-in gets what its pod's `secretKeyRef` env names, as the
    kubelet would give it: the service's internal secret among them.
    """

    def __init__(self, api: Any = None) -> None:
        super().__init__()
        self.api = api
        self._watching: threading.Event | None = None
        self.terminated: list[str] = []  # pods whose stand-in got SIGTERM because the pod was deleted

    def follow_deletions(self, namespace: str) -> None:
        """Act as the kubelet for deleted pods: a stand-in whose pod gets a deletionTimestamp (or
        disappears: KWOK deletes at once) gets SIGTERM and then its own drain time to exit."""
        from kubernetes import client, watch

        stop = self._watching = threading.Event()
        core = client.CoreV1Api(self.api)

        def run() -> None:
            while not stop.is_set():
                w = watch.Watch()
                for ev in w.stream(core.list_namespaced_pod, namespace, timeout_seconds=2):
                    pod = ev["object"]
                    if ev["type"] == "DELETED" or pod.metadata.deletion_timestamp is not None:
                        self._pod_deleted(pod.metadata.name)
                    if stop.is_set():
                        w.stop()

        threading.Thread(target=run, name="pod-deletions", daemon=True).start()

    def _pod_deleted(self, name: str) -> None:
        for child in self.children:
            if child.name == name and child.alive() and name not in self.terminated:
                self.terminated.append(name)
                child.terminate()

    def stop(self, grace_s: float = 10.0) -> None:
        if self._watching is not None:
            self._watching.set()
        super().stop(grace_s)

    def _secret(self, namespace: str, name: str, key: str) -> str:
        import base64

        from kubernetes import client

        secret = client.CoreV1Api(self.api).read_namespaced_secret(name, namespace)
        return base64.b64decode(secret.data[key]).decode()

    def _secret_env(self, pod: dict[str, Any]) -> dict[str, str]:
        if self.api is None:
            return {}
        out = {}
        for var in pod["spec"]["containers"][0].get("env") or []:
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                out[var["name"]] = self._secret(pod["metadata"]["namespace"], ref["name"], ref["key"])
        return out

    def worker_for_pod(self, pod: dict[str, Any], model: Path, kv_backend: str = "tcp",
                       env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> ManagedProcess:
        """`tandem worker` as the pod would run it: its role, IP, port, name and kv_compat (`args`:
        more flags, e.g. the engine settings its config file would give)."""
        meta, ip = pod["metadata"], pod["status"]["podIP"]
        role, port = meta["labels"]["tandem.dev/role"], pod_port(pod)
        argv = [TANDEM, "worker", "--role", role, "--model", str(model), "--host", ip,
                "--port", str(port), "--kv-backend", kv_backend, "--threads", "1", *args]
        full_env = os.environ | {
            "POD_IP": ip, "POD_NAME": meta["name"],
            "TANDEM_KV_COMPAT": meta["labels"].get("tandem.dev/kv-compat", ""),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp",
        } | self._secret_env(pod) | (env or {})
        return self.start(ManagedProcess(meta["name"], argv, full_env, url=f"http://{ip}:{port}", role=role))

    def router(self, namespace: str, service: str, port: int, kubeconfig: Path,
               host: str = "127.0.0.1", args: tuple[str, ...] = ()) -> ManagedProcess:
        """`tandem router --kubernetes` on loopback, finding the workers through the API server (`args`:
        more flags)."""
        argv = [TANDEM, "router", "--kubernetes", "--namespace", namespace, "--service", service,
                "--host", host, "--port", str(port), *args]
        env = os.environ | {"KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        if self.api is not None:  # the router pod's env names the service's internal Secret
            env[SECRET_ENV] = self._secret(namespace, f"{service}-internal", "secret")
        return self.start(ManagedProcess("router", argv, env, url=f"http://{host}:{port}", role="router"))

    def router_for_pod(self, pod: dict[str, Any], kubeconfig: Path, args: tuple[str, ...] = ()) -> ManagedProcess:
        """The router at its pod's IP and port, where the operator's planner reads its /metrics, with
        the config file the pod mounts (the service's rendered ConfigMap: its policy and limits); its
        host and port are the pod's, its logs plain text for the tests that read them."""
        meta = pod["metadata"]
        service = meta["labels"]["tandem.dev/service"]
        config = (*self._router_config(meta["namespace"], service, kubeconfig.parent), "--log-format", "text")
        return self.router(meta["namespace"], service, pod_port(pod), kubeconfig,
                           host=pod["status"]["podIP"], args=(*config, *args))

    def _router_config(self, namespace: str, service: str, folder: Path) -> tuple[str, ...]:
        """("--config", the router.yaml of the service's ConfigMap written under `folder`), or () without an API."""
        if self.api is None:
            return ()
        from kubernetes import client

        data = client.CoreV1Api(self.api).read_namespaced_config_map(f"{service}-config", namespace).data
        path = folder / f"{namespace}-{service}-router.yaml"
        path.write_text(data["router.yaml"])  # operator/render/config_files.py
        return ("--config", str(path))


def ready_pods(api: Any, namespace: str, name: str, role: str) -> list[dict]:
    """The service's pods of `role` that may get traffic (contracts.names.pod_ready), by name."""
    from kubernetes import client

    pods = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"tandem.dev/service={name},tandem.dev/role={role}").items
    return sorted((p for p in api.sanitize_for_serialization(pods) if pod_ready(p)),
                  key=lambda p: p["metadata"]["name"])
