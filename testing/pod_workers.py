"""Real processes standing in for the pods of the test control plane (KWOK runs no containers).

KWOK gives pods loopback IPs (testing/cluster.py POD_CIDR), so a `tandem worker` bound to a pod's IP
and its rendered port is reachable exactly where the operator's probe and the router's Kubernetes
discovery look for that pod. Every process is killed for sure by ProcessGroup.stop().
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

TANDEM = str(Path(sys.executable).parent / "tandem")


def pod_port(pod: dict[str, Any], default: int = 8000) -> int:
    """The container port named http, as the rendered worker pods declare it."""
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return default


class Process:
    """One child process with its log file; `url` is where its HTTP server answers."""

    def __init__(self, name: str, argv: list[str], url: str, env: dict[str, str]) -> None:
        self.name, self.argv, self.url = name, argv, url
        self.log_path = Path(tempfile.mkstemp(prefix=f"tandem-{name}-", suffix=".log")[1])
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


class ProcessGroup:
    """Workers for pods and a router, started together and stopped together (even on failure)."""

    def __init__(self) -> None:
        self.procs: list[Process] = []

    def worker_for_pod(self, pod: dict[str, Any], model: Path, kv_backend: str = "tcp",
                       env: dict[str, str] | None = None) -> Process:
        """`tandem worker` as the pod would run it: its role, IP, port, name and generation."""
        meta, ip = pod["metadata"], pod["status"]["podIP"]
        role, port = meta["labels"]["tandem.dev/role"], pod_port(pod)
        argv = [TANDEM, "worker", "--role", role, "--model", str(model), "--host", ip,
                "--port", str(port), "--kv-backend", kv_backend, "--threads", "1"]
        full_env = os.environ | {
            "POD_IP": ip, "POD_NAME": meta["name"],
            "TANDEM_GENERATION": meta["labels"].get("tandem.dev/generation", ""),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp",
        } | (env or {})
        proc = Process(meta["name"], argv, f"http://{ip}:{port}", full_env)
        self.procs.append(proc)
        return proc

    def router(self, namespace: str, service: str, port: int, kubeconfig: Path) -> Process:
        """`tandem router --kubernetes` on loopback, finding the workers through the API server."""
        argv = [TANDEM, "router", "--kubernetes", "--namespace", namespace, "--service", service,
                "--host", "127.0.0.1", "--port", str(port)]
        env = os.environ | {"KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        proc = Process("router", argv, f"http://127.0.0.1:{port}", env)
        self.procs.append(proc)
        return proc

    def wait_ready(self, procs: list[Process], path: str = "/ready", timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            while p.status(path) != 200:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.log()[-4000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{p.name} not ready in {timeout_s} s:\n{p.log()[-4000:]}")
                time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in self.procs:
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
