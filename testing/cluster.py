"""A real Kubernetes control plane on loopback, for tests and `make cluster`.

Starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler, KWOK
(fake kubelets) and the LeaderWorkerSet controller (its webhooks served on loopback,
see tandem.testing.lws_controller) from the binaries that hack/k8s-bins.sh builds
(k8s_bins.py), with the command lines of control_plane_config.py, then registers the
fake GPU/RDMA nodes of kube_nodes.py in labelled pools. Nothing here mocks the
Kubernetes API.

    python -m tandem.testing.cluster up     # writes .cluster/kubeconfig, leaves it running
    python -m tandem.testing.cluster down   # stops it and removes .cluster/  (cluster_cli.py)
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml
from tandem.testing import control_plane_config as cfg
from tandem.testing import lws_controller
from tandem.testing.components import ClusterError, Components, healthz_ok
from tandem.testing.k8s_bins import CLIENT_BINARIES, CONTROL_PLANE_BINARIES, find_bin_dir
from tandem.testing.kube_nodes import DEFAULT_NODES, POD_CIDR_OCTETS, NodeSpec, ready_nodes
from tandem.worker.local.processes import free_port

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

__all__ = ["Cluster", "ClusterError", "KubectlError", "free_port", "wait_until"]

T = TypeVar("T")


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
        controller_manager_qps: int | None = None,
    ) -> None:
        self._owns_work_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="tandem-k8s-"))
        self._bin_dir = Path(bin_dir) if bin_dir else None
        self.nodes = tuple(nodes)
        self.pod_cidr = f"127.{secrets.choice(POD_CIDR_OCTETS)}.0.1/16"
        self.startup_timeout = startup_timeout
        self.controller_manager_qps = controller_manager_qps  # None: its default (20/s, burst 30)
        self.external = False
        self.kubeconfig = self.work_dir / "kubeconfig"
        self.server = ""
        self.ca_file = self.work_dir / "pki" / "apiserver" / "apiserver.crt"
        self.admin_token = ""
        self._procs = Components(self.work_dir)
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
        tokens = cfg.static_tokens(wd / "tokens.csv")
        self.admin_token = tokens["admin"][0]
        sa_key = wd / "pki" / "sa.key"
        self._openssl("genrsa", "-out", str(sa_key), "2048")
        etcd_url = self._start_etcd(bins)
        self._start_apiserver(bins, etcd_url, sa_key)
        healthz = self._start_controllers(bins, tokens, sa_key)

        from kubernetes import client

        with self.api_client() as api:
            core = client.CoreV1Api(api)
            for node in self.nodes:
                core.create_node(node.manifest())
            self._wait_controllers(core, healthz)
            self._start_lws(bins, tokens, api)

    def _start_etcd(self, bins: Path) -> str:
        """etcd, once /health says so; its client URL."""
        port, peer_port = free_port(), free_port()
        url = f"http://127.0.0.1:{port}"
        self._procs.spawn("etcd", cfg.etcd_argv(bins, self.work_dir, port, peer_port))
        wait_until(
            lambda: (self._check_alive()
                     and json.loads(urllib.request.urlopen(f"{url}/health", timeout=2).read())["health"] == "true"),
            timeout=self.startup_timeout,
            what="etcd /health",
        )
        return url

    def _start_apiserver(self, bins: Path, etcd_url: str, sa_key: Path) -> None:
        """kube-apiserver, once /readyz answers; then the admin's kubeconfig."""
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        self._procs.spawn("kube-apiserver", cfg.apiserver_argv(bins, self.work_dir, etcd_url, port, sa_key))
        wait_until(
            lambda: self._check_alive() and self.ca_file.exists() and self._api_ready(),
            timeout=self.startup_timeout,
            what="kube-apiserver /readyz",
        )
        cfg.write_kubeconfig(self.kubeconfig, self.server, self.ca_file, "tandem-admin", self.admin_token)

    def _start_controllers(self, bins: Path, tokens: cfg.Tokens, sa_key: Path) -> dict[str, int]:
        """The controller manager, the scheduler and KWOK; the /healthz port of the first two."""
        kcm_port, sched_port = free_port(), free_port()
        wd = self.work_dir
        self._procs.spawn("kube-controller-manager", cfg.controller_manager_argv(
            bins, wd, self._component_kubeconfig("kcm", tokens), kcm_port, sa_key, self.ca_file,
            self.controller_manager_qps))
        self._procs.spawn("kube-scheduler", cfg.scheduler_argv(
            bins, wd, self._component_kubeconfig("scheduler", tokens), sched_port))
        self._procs.spawn("kwok", cfg.kwok_argv(bins, self._component_kubeconfig("kwok", tokens), self.pod_cidr))
        return {"kube-controller-manager": kcm_port, "kube-scheduler": sched_port}

    def _wait_controllers(self, core: Any, healthz: dict[str, int]) -> None:
        """Until the controllers are healthy, every node is Ready (KWOK) and namespaces get their
        `default` ServiceAccount (the serviceaccount controller runs)."""
        for name, port in healthz.items():
            wait_until(
                lambda port=port: self._check_alive() and healthz_ok(port),
                timeout=self.startup_timeout,
                what=f"{name} /healthz",
            )
        names = {n.name for n in self.nodes}
        wait_until(
            lambda: self._check_alive() and names <= ready_nodes(core),
            timeout=self.startup_timeout,
            what=f"nodes {sorted(names)} Ready (KWOK)",
        )
        wait_until(
            lambda: self._check_alive() and core.read_namespaced_service_account("default", "default"),
            timeout=self.startup_timeout,
            what="ServiceAccount default/default (kube-controller-manager)",
        )

    def _start_lws(self, bins: Path, tokens: cfg.Tokens, api: ApiClient) -> None:
        """The LeaderWorkerSet controller: its CRDs, the process, then its webhooks pointed at it."""
        crds = lws_controller.install_crds(api, bins)
        cert_dir, ca_pem = lws_controller.make_serving_cert(self.work_dir / "pki" / "lws")
        webhook_port, health_port = free_port(), free_port()
        config = self.work_dir / "lws-config.yaml"
        config.write_text(yaml.safe_dump(lws_controller.controller_config(webhook_port, health_port, cert_dir)))
        wait_until(lambda: self._check_alive() and lws_controller.crds_established(api, crds),
                   timeout=self.startup_timeout, what=f"CRDs {crds} Established")
        self._procs.spawn(
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
        self._procs.stop()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what tests use -----------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Runs kubectl as the admin; on failure (check=True) raises with its stderr."""
        return self._run("kubectl", args, input=input, check=check)

    def helm(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Runs helm (v3) as the admin against this cluster."""
        return self._run("helm", args, input=input, check=check)

    def apply_crd(self, path: Path, name: str, timeout: float = 60) -> str:
        """Applies a CRD file (server-side, so a later edit of the file updates it) and returns once
        `name` is Established. Polled: `kubectl wait` fails outright while a new CRD has no
        status.conditions yet."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        wait_until(lambda: "True" in self.kubectl(
            "get", f"crd/{name}", "-o", 'jsonpath={.status.conditions[?(@.type=="Established")].status}').stdout,
            timeout=timeout, what=f"crd/{name} Established")
        return name

    def api_client(self) -> ApiClient:
        """A kubernetes.client.ApiClient authenticated as the cluster admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubeconfig_for_token(self, token: str, path: Path) -> Path:
        """Writes a kubeconfig that authenticates with a bearer token (e.g. a ServiceAccount's)."""
        return cfg.write_kubeconfig(Path(path), self.server, self.ca_file, "token-user", token)

    # -- detached mode (make cluster) --------------------------------------

    # -- detached mode (make cluster) --------------------------------------

    def write_pids(self) -> Path:
        """Records the component pids so `down` can stop a cluster this process left running."""
        return self._procs.write_pids(self.work_dir / "pids.json")

    # -- internals ----------------------------------------------------------

    def _run(self, tool: str, args: Sequence[str], *, input: str | None, check: bool
             ) -> subprocess.CompletedProcess[str]:
        """kubectl or helm with the admin's kubeconfig; KubectlError (with stderr) on failure when `check`."""
        argv = [str(self.bin_dir / tool), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, check=False)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def _component_kubeconfig(self, who: str, tokens: cfg.Tokens) -> Path:
        token, user, _ = tokens[who]
        return cfg.write_kubeconfig(
            self.work_dir / f"{who}.kubeconfig", self.server, self.ca_file, user, token
        )

    def _openssl(self, *args: str) -> None:
        if shutil.which("openssl") is None:
            raise ClusterError(
                "openssl is needed to make the service-account signing key; "
                "install it (apt-get install openssl)"
            )
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    def _check_alive(self) -> bool:
        return self._procs.check_alive()

    def _log_tails(self) -> str:
        return self._procs.log_tails()

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


if __name__ == "__main__":
    from tandem.testing.cluster_cli import main

    sys.exit(main())
