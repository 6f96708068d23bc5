"""What each process of the test control plane starts with: its command line, and the static
tokens and kubeconfigs it authenticates with (real authentication, with the identities the
bootstrap RBAC expects). Pure, but for the files written."""

from __future__ import annotations

import secrets
from pathlib import Path

import yaml
from tandem.testing.kube_nodes import KWOK_ANNOTATION, NODE_IP

SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CIDR = "10.96.0.0/16"

# who -> (token, user, groups)
Tokens = dict[str, tuple[str, str, str]]


def static_tokens(path: Path) -> Tokens:
    """A fresh token per component, written as the API server's token file."""
    tokens = {
        "admin": (secrets.token_hex(16), "tandem-admin", "system:masters"),
        "kcm": (secrets.token_hex(16), "system:kube-controller-manager", ""),
        "scheduler": (secrets.token_hex(16), "system:kube-scheduler", ""),
        "kwok": (secrets.token_hex(16), "kwok", "system:masters"),
        "lws": (secrets.token_hex(16), "lws-controller", "system:masters"),
    }
    lines = [f'{tok},{user},{user},"{groups}"' for tok, user, groups in tokens.values()]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return tokens


def write_kubeconfig(path: Path, server: str, ca_file: Path, user: str, token: str) -> Path:
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


def etcd_argv(bins: Path, wd: Path, port: int, peer_port: int) -> list[str]:
    url = f"http://127.0.0.1:{port}"
    return [
        str(bins / "etcd"),
        f"--data-dir={wd / 'etcd'}",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
        f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
        "--unsafe-no-fsync",  # a throw-away test store; fsync on shared disks dominates start-up
        "--log-level=warn",
    ]


# The requests the API server writes to its audit log (AUDIT_LOG under the work dir): those of the
# ServiceAccounts in `default` only, where the tests' least-privilege operators run (the chart_rbac
# fixture), one line per request when it completes. Everything else (the control plane's own
# components, the tests' admin) goes unrecorded.
AUDITED_GROUP = "system:serviceaccounts:default"
AUDIT_LOG = Path("logs") / "audit.log"


def audit_policy(wd: Path) -> Path:
    policy = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
              "omitStages": ["RequestReceived", "ResponseStarted"],
              "rules": [{"level": "Metadata", "userGroups": [AUDITED_GROUP]}, {"level": "None"}]}
    path = wd / "audit-policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


def apiserver_argv(bins: Path, wd: Path, etcd_url: str, port: int, sa_key: Path) -> list[str]:
    return [
        str(bins / "kube-apiserver"),
        f"--etcd-servers={etcd_url}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        # Loopback may not be an endpoint of the `kubernetes` Service; nothing
        # in-cluster dials the API here, so that Service gets no endpoints.
        "--endpoint-reconciler-type=none",
        f"--secure-port={port}",
        f"--cert-dir={wd / 'pki' / 'apiserver'}",  # self-signed serving cert + CA, written there
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
        f"--audit-policy-file={audit_policy(wd)}",
        f"--audit-log-path={wd / AUDIT_LOG}",
        "--audit-log-format=json",
        "--audit-log-maxsize=200",  # MB, then one rotated file
        "--audit-log-maxbackup=1",
        "--v=0",
    ]


def controller_manager_argv(bins: Path, wd: Path, kubeconfig: Path, port: int, sa_key: Path,
                            ca_file: Path, qps: int | None = None) -> list[str]:
    """`qps`: its client's rate limit to the API server (burst twice that); None: the default, 20."""
    rate = [f"--kube-api-qps={qps}", f"--kube-api-burst={2 * qps}"] if qps else []
    return [
        str(bins / "kube-controller-manager"),
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={sa_key}",
        f"--root-ca-file={ca_file}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={wd / 'pki' / 'kcm'}",
        "--controllers=*",
        "--v=0",
        *rate,
    ]


def scheduler_argv(bins: Path, wd: Path, kubeconfig: Path, port: int) -> list[str]:
    return [
        str(bins / "kube-scheduler"),
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={wd / 'pki' / 'scheduler'}",
        "--v=0",
    ]


def kwok_argv(bins: Path, kubeconfig: Path, pod_cidr: str) -> list[str]:
    return [
        str(bins / "kwok"),
        f"--kubeconfig={kubeconfig}",
        f"--config={bins / 'kwok-stages.yaml'}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
        "--node-lease-duration-seconds=40",
        # Loopback pod and node IPs: a test may bind a real process to a pod's IP
        # and reach it there, and nothing ever dials outside 127.0.0.0/8.
        f"--cidr={pod_cidr}",
        f"--node-ip={NODE_IP}",
    ]
