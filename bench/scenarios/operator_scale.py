"""The operator at scale: N InferenceServices created at once on the harness's control plane with
extra fake CPU nodes, the time until all are Ready, then the idle operator's CPU and memory.

    python -m bench operator_scale [--services 100] [--idle-s 120] [--resync-s 30] [--no-kv-probe]

Starts etcd, kube-apiserver, controller-manager, scheduler and KWOK (tandem.testing.cluster) with
enough fake CPU nodes for the pods (3 per service: prefill, decode, router), installs the CRD,
starts `tandem operator --all-namespaces` as a subprocess (its defaults, the KV probe on: the
probes find nothing listening at KWOK's pod IPs), creates N InferenceServices from 16 threads,
and polls (once a second; every N/200 s above 200) until every one is Ready for its generation.
Then it measures the operator over an idle window: CPU (user+system, as a fraction of one core) and RSS. The
control plane shares the machine: the operator's figures are its own process's, but its speed
depends on the API server's; read them as rough on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from tandem.testing.cluster import Cluster, free_port, wait_until
from tandem.testing.kube_nodes import DEFAULT_NODES, POOL_LABEL, NodeSpec

CRD = Path(__file__).resolve().parents[2] / "crds" / "inferenceservices.tandem.dev.yaml"
GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
PODS_PER_NODE = 100  # the harness's nodes allow 110


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--services", type=int, default=100, help="InferenceServices created at once")
    p.add_argument("--idle-s", type=float, default=120.0, help="the idle window measured after all are Ready")
    p.add_argument("--settle-s", type=float, default=15.0, help="wait this long after Ready before the window")
    p.add_argument("--resync-s", type=float, default=60.0, help="the operator's --resync-seconds")
    p.add_argument("--workers", type=int, default=16, help="the operator's --workers")
    p.add_argument("--no-kv-probe", action="store_true", help="run the operator with --no-kv-probe")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)
    p.add_argument("--controller-manager-qps", type=int, default=None,
                   help="the control plane's kube-controller-manager client rate (default: its own, 20/s): "
                        "how fast it creates pods bounds Ready")


def spec() -> dict:
    role = {"replicas": 1, "gpus": 0, "cpu": "10m", "memory": "64Mi", "nodeSelector": {POOL_LABEL: "cpu"}}
    return {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role), "kvTransfer": {"backend": "tcp"},
            "router": {"cpu": "10m", "memory": "64Mi"}}


class Sampler:
    """The operator process's CPU seconds and RSS, sampled every second in a thread."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak_rss = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def cpu(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def rss(self) -> int:
        return self.proc.memory_info().rss


def _ready_count(api, namespace: str) -> tuple[int, int]:
    from kubernetes import client

    items = client.CustomObjectsApi(api).list_namespaced_custom_object(*GVP[:2], namespace, GVP[2])["items"]
    ready = 0
    for tis in items:
        st = tis.get("status") or {}
        cond = next((c for c in st.get("conditions") or [] if c["type"] == "Ready"), {})
        ready += cond.get("status") == "True" and st.get("observedGeneration") == tis["metadata"]["generation"]
    return ready, len(items)


def _create_all(api, namespace: str, n: int) -> float:
    """Creates n InferenceServices from 16 threads; returns the seconds it took."""
    from kubernetes import client

    crds = client.CustomObjectsApi(api)

    def create(i: int) -> None:
        body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": f"svc-{i:04d}"}, "spec": spec()}
        crds.create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)

    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(create, range(n)))
    return time.monotonic() - t0


def _operator(cluster: Cluster, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [str(Path(sys.executable).parent / "tandem"), "operator", "--all-namespaces", "--log-format", "json",
            "--liveness", f"http://127.0.0.1:{port}/healthz", "--resync-seconds", str(args.resync_s),
            "--workers", str(args.workers), *(["--no-kv-probe"] if args.no_kv_probe else [])]
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _scrape(base: str) -> dict[str, float]:
    from tandem.testing.scraped import scrape, value

    m = scrape(base + "/metrics")
    return {"passes": value(m, "tandem_operator_reconciles_total"), "depth": value(m, "tandem_operator_queue_depth"),
            "active": value(m, "tandem_operator_queue_active"),
            "spec_passes": value(m, "tandem_operator_reconciles_total", trigger="spec"),
            "pass_seconds": value(m, "tandem_operator_reconcile_duration_seconds_sum"),
            "api_calls": value(m, "tandem_operator_api_requests_total"),
            "api_seconds": value(m, "tandem_operator_api_request_duration_seconds_sum"),
            "scrape_failures": value(m, "tandem_operator_scrape_failures_total")}


def _namespace(api, namespace: str) -> None:
    from kubernetes import client

    client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
    wait_until(lambda: client.CoreV1Api(api).read_namespaced_service_account("default", namespace),
               timeout=60, what="the namespace's default ServiceAccount")


def _until_ready(api, namespace: str, base: str, sampler: Sampler, args: argparse.Namespace) -> dict:
    """Create every InferenceService, then poll once a second until all are Ready: the seconds, the
    operator's CPU and metrics by then, and the progress seen on the way."""
    from kubernetes import client

    cpu0, t0 = sampler.cpu(), time.monotonic()
    create_s = _create_all(api, namespace, args.services)
    progress: list[tuple] = []
    # when every service's first pass had run and no pass was queued or running
    drained: dict[str, float] = {}

    def all_ready() -> bool:
        ready, _ = _ready_count(api, namespace)
        # Raw JSON: the client's models take seconds of this machine's CPU for thousands of pods.
        raw = client.CoreV1Api(api).list_namespaced_pod(namespace, _preload_content=False)
        pods = json.loads(raw.data)["items"]
        running = sum(1 for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                             for c in (p.get("status") or {}).get("conditions") or []))
        q = _scrape(base)
        # (s, services Ready, pods, pods Ready, queue depth, passes so far)
        progress.append((round(time.monotonic() - t0, 1), ready, len(pods), running, q["depth"], q["passes"]))
        if "queue_empty_s" not in drained and q["spec_passes"] >= args.services and q["depth"] + q["active"] == 0:
            drained["queue_empty_s"] = round(time.monotonic() - t0, 1)
        return ready == args.services

    # Once a second up to 200 services, then less often: the polls share the control plane's cores.
    wait_until(all_ready, timeout=args.ready_timeout_s, interval=max(1.0, args.services / 200),
               what="every InferenceService Ready")
    ready_s, cpu_ready, at_ready = time.monotonic() - t0, sampler.cpu() - cpu0, _scrape(base)
    return {
        "create_s": round(create_s, 2), "ready_s": round(ready_s, 1), **drained,
        "ready_progress": progress[:: max(1, len(progress) // 40)],
        "cpu_until_ready_s": round(cpu_ready, 2),
        "passes_until_ready": at_ready["passes"], "api_calls_until_ready": at_ready["api_calls"],
        "api_mean_latency_ms_until_ready": round(1000 * at_ready["api_seconds"] / max(1, at_ready["api_calls"]), 1),
    }


def _idle(base: str, sampler: Sampler, args: argparse.Namespace) -> dict:
    """The operator over an idle window, after a settling pause: CPU, API calls, passes, scrape failures."""
    time.sleep(args.settle_s)
    before, cpu1, t1 = _scrape(base), sampler.cpu(), time.monotonic()
    time.sleep(args.idle_s)
    idle_cpu, idle_wall, after = sampler.cpu() - cpu1, time.monotonic() - t1, _scrape(base)

    def rate(key: str) -> float:
        return round((after[key] - before[key]) / idle_wall, 2)

    return {"idle_api_calls_per_s": rate("api_calls"), "idle_cpu_core_fraction": round(idle_cpu / idle_wall, 4),
            "idle_window_s": round(idle_wall, 1), "idle_passes_per_s": rate("passes"),
            "idle_scrape_failures_per_s": rate("scrape_failures")}


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(args: argparse.Namespace) -> dict:
    nodes = (*DEFAULT_NODES, *(NodeSpec(f"cpu-extra-{i}", "cpu", gpus=False)
                               for i in range(math.ceil(3 * args.services / PODS_PER_NODE))))
    work = Path(tempfile.mkdtemp(prefix="tandem-scale-"))
    cluster = Cluster(work, nodes=nodes, startup_timeout=600, controller_manager_qps=args.controller_manager_qps).start()
    proc = None
    try:
        cluster.apply_crd(CRD, "inferenceservices.tandem.dev")
        proc, base = _operator(cluster, args, args.out_dir / "operator.log")
        wait_until(lambda: psutil.pid_exists(proc.pid) and _scrape(base) is not None, timeout=120,
                   what="the operator's /metrics")
        sampler = Sampler(proc.pid)
        with cluster.api_client() as api:
            _namespace(api, "scale")
            ready = _until_ready(api, "scale", base, sampler, args)
            idle = _idle(base, sampler, args)
        sampler.stop.set()
        print(f"{args.services} services: all Ready after {ready['ready_s']:.1f} s "
              f"({ready['cpu_until_ready_s']:.1f} s of operator CPU); "
              f"idle {100 * idle['idle_cpu_core_fraction']:.1f}% of a core, RSS {sampler.rss() / 2**20:.0f} MB "
              f"(peak {sampler.peak_rss / 2**20:.0f} MB)", flush=True)
        return {
            "services": args.services, "nodes": len(nodes), "resync_s": args.resync_s, "workers": args.workers,
            "controller_manager_qps": args.controller_manager_qps,
            "kv_probe": not args.no_kv_probe, **ready, **idle,
            "rss_mb": round(sampler.rss() / 2**20, 1), "peak_rss_mb": round(sampler.peak_rss / 2**20, 1),
            "machine_cpus": os.cpu_count(), "loadavg": list(os.getloadavg()),
        }
    finally:
        _stop(proc)
        cluster.stop()
