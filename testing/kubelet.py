"""The kubelet's part, for pods no kubelet runs (KWOK's nodes run nothing, and a pod that is not
scheduled has no node at all): run a rendered container's own command here, and write a pod's
end into its status as the kubelet would, so the controllers above it (the Job controller, the
operator) react to a real outcome."""

from __future__ import annotations

import base64
import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kubernetes import client


def run_container(api: Any, namespace: str, container: dict, mounts: dict[str, Path]) -> subprocess.CompletedProcess:
    """A rendered container's own `tandem ...` command, with its env (secretKeyRef read as the
    kubelet reads it) and its volume mounts mapped to local folders."""
    def local(text: str) -> str:
        for mount, folder in mounts.items():
            text = text.replace(mount, str(folder))
        return text

    env = dict(os.environ)
    for var in container.get("env") or []:
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            secret = client.CoreV1Api(api).read_namespaced_secret(ref["name"], namespace)
            env[var["name"]] = base64.b64decode(secret.data[ref["key"]]).decode()
        else:
            env[var["name"]] = local(var["value"])
    argv = [str(Path(sys.executable).parent / "tandem"), *map(local, container["command"][1:])]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _terminated(exit_code: int, message: str) -> dict[str, Any]:
    now = _now()
    return {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "startedAt": now,
            "finishedAt": now, **({"message": message} if message else {})}


def finish_pod(api: Any, namespace: str, pod: str, exit_code: int, message: str = "") -> None:
    """Writes the pod's end as the kubelet does: its one container terminated with `exit_code` and
    `message` (the termination message), the pod Succeeded (0) or Failed."""
    core = client.CoreV1Api(api)
    spec = core.read_namespaced_pod(pod, namespace).spec
    (container,) = spec.containers
    core.patch_namespaced_pod_status(pod, namespace, {"status": {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "containerStatuses": [{"name": container.name, "image": container.image, "imageID": "", "ready": False,
                               "restartCount": 0, "state": {"terminated": _terminated(exit_code, message)}}]}})


def end_init_container(api: Any, namespace: str, pod: str, exit_code: int, message: str = "") -> None:
    """Writes a pending pod's one init container's end as the kubelet does: done (0), or failed and
    waiting in CrashLoopBackOff to run again (restartPolicy Always), its last end kept in lastState."""
    core = client.CoreV1Api(api)
    spec = core.read_namespaced_pod(pod, namespace).spec
    (init,) = spec.init_containers
    ended = _terminated(exit_code, message)
    state = {"state": {"terminated": ended}} if exit_code == 0 else {
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off restarting {init.name}"}},
        "lastState": {"terminated": ended}}
    waiting = {"waiting": {"reason": "PodInitializing"}}
    core.patch_namespaced_pod_status(pod, namespace, {"status": {
        "phase": "Pending",
        "initContainerStatuses": [{"name": init.name, "image": init.image, "imageID": "", "ready": exit_code == 0,
                                   "restartCount": 0 if exit_code == 0 else 1, **state}],
        "containerStatuses": [{"name": c.name, "image": c.image, "imageID": "", "ready": False, "restartCount": 0,
                               "state": waiting} for c in spec.containers]}})
