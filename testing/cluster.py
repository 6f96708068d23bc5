"""A real Kubernetes control plane on loopback, for tests and `make cluster`.

Starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler, KWOK
(fake kubelets) and the LeaderWorkerSet controller (its webhooks served on loopback,
see tandem.testing.lws_controller) from the binaries that hack/k8s-bins.sh builds,
then registers fake GPU/RDMA nodes in labelled pools. Nothing here mocks the
Kubernetes API.

GPU nodes carry the taint `nvidia.com/gpu=present:NoSchedule` (as GPU clusters
usually do): workloads meant for them must tolerate it (see GPU_TOLERATION).

    python -m tandem.testing.cluster up     # writes .cluster/kubeconfig, leaves it running
    python -m tandem.testing.cluster down   # stops it and removes .cluster/
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml
from tandem.testing import lws_controller
from tandem.worker.local.processes import free_port

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

REPO_ROOT = Path(__file__).resolve().parents[1]
K8S_BINS_SCRIPT = REPO_ROOT / "hack" / "k8s-bins.sh"

CONTROL_PLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
    "kwok-stages.yaml",
    *lws_controller.LWS_BINARIES,
)
CLIENT_BINARIES = ("kubectl", "helm")

POOL_LABEL = "tandem.dev/pool"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
# What a pod spec needs to land on the GPU pools.
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}

GPU_RESOURCES = {
    "nvidia.com/gpu": "8",
    "rdma/ib": "4",
    "rdma/rdma_shared_device_a": "4",
}
BASE_RESOURCES = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}

SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CIDR = "10.96.0.0/16"
# KWOK gives pods IPs from a loopback /16 (first one 127.<n>.0.2) and nodes this InternalIP. Each
# cluster draws its own <n>: test sessions running side by side on one machine (each binding real
# processes to its pods' IPs) would otherwise hand out, and bind, the same addresses.
POD_CIDR_OCTETS = range(50, 250)  # Cluster.pod_cidr: 127.<one of these>.0.1/16
NODE_IP = "127.49.0.1"

T = TypeVar("T")


@dataclass(frozen=True)
class NodeSpec:
    """One fake node: its name, pool and whether it has GPUs (and so the GPU taint)."""

    name: str
    pool: str
    gpus: bool = True

    def manifest(self) -> dict[str, Any]:
        """The Node object KWOK takes over; capacity is set at creation like a kubelet would."""
        resources = dict(BASE_RESOURCES)
        if self.gpus:
            resources.update(GPU_RESOURCES)
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            POOL_LABEL: self.pool,
        }
        if self.gpus:
            labels["nvidia.com/gpu.present"] = "true"
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {"taints": [dict(GPU_TAINT)] if self.gpus else []},
            "status": {"capacity": resources, "allocatable": resources},
        }


DEFAULT_NODES: tuple[NodeSpec, ...] = (
    NodeSpec("prefill-0", "prefill"),
    NodeSpec("prefill-1", "prefill"),
    NodeSpec("decode-0", "decode"),
    NodeSpec("decode-1", "decode"),
    NodeSpec("cpu-0", "cpu", gpus=False),
)


class ClusterError(RuntimeError):
    """The control plane could not be found, started or reached; the message says what to do."""


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl/helm call whose message carries its stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {self.stderr}\nstdout: {self.stdout}"


def wait_until(
    predicate: Callable[[], T], *, timeout: float, what: str, interval: float = 0.2
) -> T:
    """Polls until predicate() is truthy (exceptions count as not yet) and returns it."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except ClusterError:
            raise  # a component died: waiting longer cannot help
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


def _missing(bin_dir: Path, names: Sequence[str]) -> list[str]:
    return [n for n in names if not (bin_dir / n).exists()]


def find_bin_dir(required: Sequence[str] = CONTROL_PLANE_BINARIES) -> Path:
    """The dir with the control-plane binaries: $KUBEBUILDER_ASSETS, else what
    `hack/k8s-bins.sh --print-dir` names (which never builds)."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and not _missing(Path(assets), required):
        return Path(assets)
    if not K8S_BINS_SCRIPT.exists():
        raise ClusterError(
            f"{K8S_BINS_SCRIPT} not found (tandem.testing is not installed from the repo); "
            f"set KUBEBUILDER_ASSETS to a dir holding {', '.join(required)}"
        )
    proc = subprocess.run(
        ["bash", str(K8S_BINS_SCRIPT), "--print-dir"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise ClusterError(f"hack/k8s-bins.sh --print-dir failed: {proc.stderr.strip()}")
    bin_dir = Path(proc.stdout.strip())
    missing = _missing(bin_dir, required)
    if missing:
        raise ClusterError(
            f"control-plane binaries missing from {bin_dir}: {', '.join(missing)}; "
            "run `make test` or `hack/k8s-bins.sh` to build them (KUBEBUILDER_ASSETS="
            f"{assets or '<unset>'})"
        )
    return bin_dir


def _write_kubeconfig(path: Path, server: str, ca_file: Path, user: str, token: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "tandem", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "tandem", "context": {"cluster": "tandem", "user": user}}],
        "current-context": "tandem",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


@dataclass
class _Proc:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes] | None = None
    pid: int = 0
    log: Path = field(default_factory=Path)


class Cluster:
    """etcd + kube-apiserver + controller-manager + scheduler + KWOK on free loopback
    ports in a work dir, or (external=True) a user's cluster reached by kubeconfig."""

    def __init__(
        self,
        work_dir: Path | None = None,
        bin_dir: Path | None = None,
        *,
        nodes: Sequence[NodeSpec] = DEFAULT_NODES,
        startup_timeout: float = 180.0,
    ) -> None:
        self._owns_work_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="tandem-k8s-"))
        self._bin_dir = Path(bin_dir) if bin_dir else None
        self.nodes = tuple(nodes)
        self.pod_cidr = f"127.{secrets.choice(POD_CIDR_OCTETS)}.0.1/16"
        self.startup_timeout = startup_timeout
        self.external = False
        self.kubeconfig = self.work_dir / "kubeconfig"
        self.server = ""
        self.ca_file = self.work_dir / "pki" / "apiserver" / "apiserver.crt"
        self.admin_token = ""
        self._procs: list[_Proc] = []
        self.startup_seconds: float | None = None

    # -- construction -------------------------------------------------------

    @classmethod
    def from_kubeconfig(cls, kubeconfig: Path) -> Cluster:
        """A user's running cluster: nothing is started or stopped, only used."""
        kubeconfig = Path(kubeconfig).expanduser().resolve()
        if not kubeconfig.is_file():
            raise ClusterError(f"TANDEM_TEST_KUBECONFIG={kubeconfig} is not a file")
        self = cls(nodes=())
        self.external = True
        self.kubeconfig = kubeconfig
        config = yaml.safe_load(kubeconfig.read_text())
        contexts = {c["name"]: c["context"] for c in config.get("contexts", [])}
        context = contexts[config["current-context"]]
        clusters = {c["name"]: c["cluster"] for c in config.get("clusters", [])}
        entry = clusters[context["cluster"]]
        self.server = entry["server"]
        if "certificate-authority-data" in entry:
            self.ca_file = self.work_dir / "ca.crt"
            self.ca_file.write_bytes(base64.b64decode(entry["certificate-authority-data"]))
        elif "certificate-authority" in entry:
            ca = Path(entry["certificate-authority"])
            self.ca_file = ca if ca.is_absolute() else kubeconfig.parent / ca
        return self

    @classmethod
    def from_env(cls, work_dir: Path | None = None) -> Cluster:
        """TANDEM_TEST_KUBECONFIG names a user's cluster; otherwise a new local one (not started)."""
        external = os.environ.get("TANDEM_TEST_KUBECONFIG")
        if external:
            return cls.from_kubeconfig(Path(external))
        return cls(work_dir)

    @property
    def bin_dir(self) -> Path:
        """Dir with kubectl, helm, kube-apiserver, ... (built by hack/k8s-bins.sh)."""
        if self._bin_dir is None:
            needed = CLIENT_BINARIES if self.external else CONTROL_PLANE_BINARIES
            self._bin_dir = find_bin_dir(needed)
        return self._bin_dir

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> Cluster:
        """Starts every component and returns once the API is ready and the nodes are Ready."""
        if self.external:
            wait_until(self._api_ready, timeout=30, what=f"{self.server}/readyz")
            return self
        t0 = time.monotonic()
        bins = self.bin_dir
        try:
            self._start(bins)
        except BaseException as exc:
            logs = self._log_tails()
            self.stop()
            if isinstance(exc, Exception):
                raise ClusterError(f"control plane failed to start: {exc}\n{logs}") from exc
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _start(self, bins: Path) -> None:
        wd = self.work_dir
        for sub in ("logs", "etcd", "pki/apiserver", "pki/kcm", "pki/scheduler"):
            (wd / sub).mkdir(parents=True, exist_ok=True)

        # Static tokens: real authentication, with the identities the bootstrap RBAC expects.
        tokens = {
            "admin": (secrets.token_hex(16), "tandem-admin", "system:masters"),
            "kcm": (secrets.token_hex(16), "system:kube-controller-manager", ""),
            "scheduler": (secrets.token_hex(16), "system:kube-scheduler", ""),
            "kwok": (secrets.token_hex(16), "kwok", "system:masters"),
            "lws": (secrets.token_hex(16), "lws-controller", "system:masters"),
        }
        lines = [f'{tok},{user},{user},"{groups}"' for tok, user, groups in tokens.values()]
        (wd / "tokens.csv").write_text("\n".join(lines) + "\n")
        (wd / "tokens.csv").chmod(0o600)
        self.admin_token = tokens["admin"][0]

        sa_key = wd / "pki" / "sa.key"
        self._openssl("genrsa", "-out", str(sa_key), "2048")

        etcd_port, etcd_peer = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn(
            "etcd",
            [
                str(bins / "etcd"),
                f"--data-dir={wd / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",  # a throw-away test store; fsync on shared disks dominates start-up
                "--log-level=warn",
            ],
        )
        wait_until(
            lambda: (
                self._check_alive()
                and json.loads(urllib.request.urlopen(f"{etcd_url}/health", timeout=2).read())[
                    "health"
                ]
                == "true"
            ),
            timeout=self.startup_timeout,
            what="etcd /health",
        )

        api_port = free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        cert_dir = wd / "pki" / "apiserver"
        self._spawn(
            "kube-apiserver",
            [
                str(bins / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # Loopback may not be an endpoint of the `kubernetes` Service; nothing
                # in-cluster dials the API here, so that Service gets no endpoints.
                "--endpoint-reconciler-type=none",
                f"--secure-port={api_port}",
                f"--cert-dir={cert_dir}",  # self-signed serving cert + CA, written there
                f"--token-auth-file={wd / 'tokens.csv'}",
                "--anonymous-auth=false",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={sa_key}",
                f"--service-account-signing-key-file={sa_key}",
                f"--api-audiences={SA_ISSUER}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=0",
            ],
        )
        wait_until(
            lambda: self._check_alive() and self.ca_file.exists() and self._api_ready(),
            timeout=self.startup_timeout,
            what="kube-apiserver /readyz",
        )
        _write_kubeconfig(
            self.kubeconfig, self.server, self.ca_file, "tandem-admin", self.admin_token
        )

        kcm_port, sched_port = free_port(), free_port()
        self._spawn(
            "kube-controller-manager",
            [
                str(bins / "kube-controller-manager"),
                f"--kubeconfig={self._component_kubeconfig('kcm', tokens)}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={self.ca_file}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--cert-dir={wd / 'pki' / 'kcm'}",
                "--controllers=*",
                "--v=0",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(bins / "kube-scheduler"),
                f"--kubeconfig={self._component_kubeconfig('scheduler', tokens)}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                f"--cert-dir={wd / 'pki' / 'scheduler'}",
                "--v=0",
            ],
        )
        self._spawn(
            "kwok",
            [
                str(bins / "kwok"),
                f"--kubeconfig={self._component_kubeconfig('kwok', tokens)}",
                f"--config={bins / 'kwok-stages.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--node-lease-duration-seconds=40",
                # Loopback pod and node IPs: a test may bind a real process to a pod's IP
                # and reach it there, and nothing ever dials outside 127.0.0.0/8.
                f"--cidr={self.pod_cidr}",
                f"--node-ip={NODE_IP}",
            ],
        )

        from kubernetes import client

        with self.api_client() as api:
            core = client.CoreV1Api(api)
            for node in self.nodes:
                core.create_node(node.manifest())
            for name, port in (
                ("kube-controller-manager", kcm_port),
                ("kube-scheduler", sched_port),
            ):
                wait_until(
                    lambda port=port: self._check_alive() and self._local_healthz(port),
                    timeout=self.startup_timeout,
                    what=f"{name} /healthz",
                )
            names = {n.name for n in self.nodes}
            wait_until(
                lambda: self._check_alive() and names <= self._ready_nodes(core),
                timeout=self.startup_timeout,
                what=f"nodes {sorted(names)} Ready (KWOK)",
            )
            # The serviceaccount controller runs: namespaces get their `default` account.
            wait_until(
                lambda: (
                    self._check_alive()
                    and core.read_namespaced_service_account("default", "default")
                ),
                timeout=self.startup_timeout,
                what="ServiceAccount default/default (kube-controller-manager)",
            )
            self._start_lws(bins, tokens, api)

    def _start_lws(self, bins: Path, tokens: dict[str, tuple[str, str, str]], api: ApiClient) -> None:
        """The LeaderWorkerSet controller: its CRDs, the process, then its webhooks pointed at it."""
        crds = lws_controller.install_crds(api, bins)
        cert_dir, ca_pem = lws_controller.make_serving_cert(self.work_dir / "pki" / "lws")
        webhook_port, health_port = free_port(), free_port()
        config = self.work_dir / "lws-config.yaml"
        config.write_text(yaml.safe_dump(lws_controller.controller_config(webhook_port, health_port, cert_dir)))
        wait_until(lambda: self._check_alive() and lws_controller.crds_established(api, crds),
                   timeout=self.startup_timeout, what=f"CRDs {crds} Established")
        self._spawn(
            "lws-controller",
            [str(bins / "lws-controller"), f"--config={config}", "--zap-log-level=info"],
            env={"KUBECONFIG": str(self._component_kubeconfig("lws", tokens))},
        )
        wait_until(
            lambda: (self._check_alive() and lws_controller.port_open(webhook_port)
                     and urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=2).status
                     == 200),
            timeout=self.startup_timeout,
            what="lws-controller /readyz and its webhook server",
        )
        lws_controller.install(api, bins, f"https://127.0.0.1:{webhook_port}", ca_pem)

    def stop(self) -> None:
        """Kills every component's process group (SIGTERM, then SIGKILL) and removes the work dir."""
        if self.external:
            if self._owns_work_dir:
                shutil.rmtree(self.work_dir, ignore_errors=True)
            return
        for proc in reversed(self._procs):
            _signal_group(proc.pid, signal.SIGTERM)
        # Short grace: the store is thrown away, so a clean shutdown buys nothing.
        deadline = time.monotonic() + 3
        for proc in reversed(self._procs):
            if proc.popen is not None:
                try:
                    proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            _signal_group(proc.pid, signal.SIGKILL)
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=5)
        self._procs.clear()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what tests use -----------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Runs kubectl as the admin; on failure (check=True) raises with its stderr."""
        return self._run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            check=check,
        )

    def helm(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Runs helm (v3) as the admin against this cluster."""
        return self._run(
            [str(self.bin_dir / "helm"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            check=check,
        )

    def api_client(self) -> ApiClient:
        """A kubernetes.client.ApiClient authenticated as the cluster admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubeconfig_for_token(self, token: str, path: Path) -> Path:
        """Writes a kubeconfig that authenticates with a bearer token (e.g. a ServiceAccount's)."""
        return _write_kubeconfig(Path(path), self.server, self.ca_file, "token-user", token)

    # -- detached mode (make cluster) --------------------------------------

    def write_pids(self) -> Path:
        """Records the component pids so `down` can stop a cluster this process left running."""
        path = self.work_dir / "pids.json"
        path.write_text(
            json.dumps([{"name": p.name, "pid": p.pid, "exe": p.argv[0]} for p in self._procs])
        )
        return path

    # -- internals ----------------------------------------------------------

    def _run(
        self, argv: list[str], *, input: str | None, check: bool
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, check=False)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def _component_kubeconfig(self, who: str, tokens: dict[str, tuple[str, str, str]]) -> Path:
        token, user, _ = tokens[who]
        return _write_kubeconfig(
            self.work_dir / f"{who}.kubeconfig", self.server, self.ca_file, user, token
        )

    def _openssl(self, *args: str) -> None:
        if shutil.which("openssl") is None:
            raise ClusterError(
                "openssl is needed to make the service-account signing key; "
                "install it (apt-get install openssl)"
            )
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = self.work_dir / "logs" / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv,
                env=None if env is None else os.environ | env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() kills it whole
                cwd=self.work_dir,
            )
        self._procs.append(_Proc(name, argv, popen, popen.pid, log))

    def _check_alive(self) -> bool:
        for proc in self._procs:
            if proc.popen is not None and proc.popen.poll() is not None:
                raise ClusterError(f"{proc.name} exited with code {proc.popen.returncode}")
        return True

    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def _api_ready(self) -> bool:
        if self.external:
            proc = self.kubectl("get", "--raw=/readyz", check=False)
            return proc.returncode == 0 and proc.stdout.strip() == "ok"
        req = urllib.request.Request(
            f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"}
        )
        try:
            with urllib.request.urlopen(req, context=self._ssl_context(), timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    @staticmethod
    def _local_healthz(port: int) -> bool:
        # The component serves /healthz on its own self-signed cert; it is only a liveness probe.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(
                f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=5
            ) as resp:
                return resp.read().strip() == b"ok"
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    @staticmethod
    def _ready_nodes(core: Any) -> set[str]:
        ready = set()
        for node in core.list_node().items:
            for cond in node.status.conditions or []:
                if cond.type == "Ready" and cond.status == "True":
                    ready.add(node.metadata.name)
        return ready

    def _log_tails(self, lines: int = 15) -> str:
        out = []
        for proc in self._procs:
            try:
                text = proc.log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {proc.name} ({proc.log}) ---\n" + "\n".join(text))
        return "\n".join(out)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    if pid <= 0:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _pid_runs(pid: int, exe: str) -> bool:
    """True when pid is alive and still runs exe (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and cmdline[0].decode(errors="replace") == exe


def cluster_up(state_dir: Path) -> Cluster:
    """Starts a detached cluster in state_dir (kubeconfig, logs, pids.json) and returns it."""
    pids = state_dir / "pids.json"
    if pids.exists() and any(_pid_runs(p["pid"], p["exe"]) for p in json.loads(pids.read_text())):
        raise ClusterError(
            f"a cluster is already running from {state_dir}; stop it with `make cluster-down`"
        )
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)
    cluster = Cluster(work_dir=state_dir).start()
    cluster.write_pids()
    return cluster


def cluster_down(state_dir: Path) -> int:
    """Stops the components recorded in state_dir/pids.json and removes state_dir."""
    pids = state_dir / "pids.json"
    stopped = 0
    if pids.exists():
        procs = [p for p in json.loads(pids.read_text()) if _pid_runs(p["pid"], p["exe"])]
        for p in reversed(procs):
            _signal_group(p["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(_pid_runs(p["pid"], p["exe"]) for p in procs):
            time.sleep(0.1)
        for p in procs:
            if _pid_runs(p["pid"], p["exe"]):
                _signal_group(p["pid"], signal.SIGKILL)
        stopped = len(procs)
    shutil.rmtree(state_dir, ignore_errors=True)
    return stopped


def main(argv: Sequence[str] | None = None) -> int:
    """`up` leaves a cluster running with .cluster/kubeconfig; `down` stops it."""
    parser = argparse.ArgumentParser(
        prog="python -m tandem.testing.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path.cwd() / ".cluster",
        help="state dir: kubeconfig, logs, pids.json (default: ./.cluster)",
    )
    args = parser.parse_args(argv)
    state_dir = args.dir.resolve()
    try:
        if args.action == "up":
            cluster = cluster_up(state_dir)
            print(f"cluster up in {cluster.startup_seconds:.1f}s: {cluster.server}")
            print(f"  kubectl --kubeconfig {cluster.kubeconfig} get nodes -L {POOL_LABEL}")
            print(f"  binaries: {cluster.bin_dir}; logs: {state_dir / 'logs'}")
            print("  stop it with: make cluster-down")
        else:
            stopped = cluster_down(state_dir)
            print(f"cluster down ({stopped} processes stopped)")
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
