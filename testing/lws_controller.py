"""The LeaderWorkerSet controller (sigs.k8s.io/lws) as a process of the test control plane.

In a cluster it runs as a pod behind a Service, and the API server calls its admission webhooks
through that Service with a certificate its own rotator makes. Here nothing runs in a pod, so the
harness plays that part: it makes a CA and a serving certificate for 127.0.0.1, starts the
controller with its webhook server on a free loopback port (internal certificate management
off), installs the CRDs hack/k8s-bins.sh copied from the module, and registers the module's
webhook configurations (with its kustomize patches: the pod webhooks only see LWS pods) pointing
at `https://127.0.0.1:<port>` by URL, with the CA as caBundle.
"""

from __future__ import annotations

import base64
import copy
import socket
import subprocess
from pathlib import Path
from typing import Any

import yaml

LWS_BINARIES = ("lws-controller", "lws-crds.yaml", "lws-webhooks.yaml")
LWS_GROUP = "leaderworkerset.x-k8s.io"


def make_serving_cert(pki: Path) -> tuple[Path, bytes]:
    """A throw-away CA and a certificate for IP 127.0.0.1 signed by it, as tls.crt/tls.key in `pki`
    (controller-runtime's webhook server reads those names). Returns (cert dir, CA PEM)."""
    pki.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=pki)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tandem-lws-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "tls.key",
            "-out", "tls.csr")
    (pki / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.cnf", "-out", "tls.crt")
    return pki, (pki / "ca.crt").read_bytes()


def controller_config(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """The controller's --config (config.lws.x-k8s.io/v1alpha1): one replica, our certificate,
    loopback only, no metrics server."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
    }


def webhook_configurations(manifests: str, base_url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """The module's webhook configurations with its patches applied, each webhook called by URL.

    lws-webhooks.yaml holds config/webhook/manifests.yaml and the two kustomize patches, each a
    list of JSON-patch `replace` ops whose value is a whole webhook: it replaces the webhook of the
    same name (what the kustomization's `/webhooks/1` paths point at).
    """
    docs = [d for d in yaml.safe_load_all(manifests) if d]
    configs = [copy.deepcopy(d) for d in docs if isinstance(d, dict)]
    for ops in (d for d in docs if isinstance(d, list)):
        for op in ops:
            if op.get("op") != "replace" or not isinstance(op.get("value"), dict):
                raise ValueError(f"lws-webhooks.yaml: unexpected patch {op!r}")
            _replace_webhook(configs, op["value"])
    bundle = base64.b64encode(ca_pem).decode()
    for config in configs:
        config["metadata"]["name"] = "lws-" + config["metadata"]["name"]
        for hook in config["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": base_url + path, "caBundle": bundle}
    return configs


def _replace_webhook(configs: list[dict[str, Any]], webhook: dict[str, Any]) -> None:
    for config in configs:
        for i, hook in enumerate(config.get("webhooks") or []):
            if hook.get("name") == webhook.get("name"):
                config["webhooks"][i] = copy.deepcopy(webhook)
                return
    raise ValueError(f"lws-webhooks.yaml: a patch names webhook {webhook.get('name')!r}, which no "
                     "configuration has")


def port_open(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:port."""
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def install(api: Any, bins: Path, base_url: str, ca_pem: bytes) -> None:
    """Registers the webhook configurations (create or replace): after the webhook server is up."""
    from kubernetes import client

    admission = client.AdmissionregistrationV1Api(api)
    for config in webhook_configurations((bins / "lws-webhooks.yaml").read_text(), base_url, ca_pem):
        create, replace = {
            "MutatingWebhookConfiguration": (admission.create_mutating_webhook_configuration,
                                             admission.replace_mutating_webhook_configuration),
            "ValidatingWebhookConfiguration": (admission.create_validating_webhook_configuration,
                                               admission.replace_validating_webhook_configuration),
        }[config["kind"]]
        try:
            create(config)
        except client.ApiException as e:
            if e.status != 409:
                raise
            replace(config["metadata"]["name"], config)


def install_crds(api: Any, bins: Path) -> list[str]:
    """Creates the module's CRDs (idempotent); returns their names."""
    from kubernetes import client

    ext = client.ApiextensionsV1Api(api)
    names = []
    for crd in (d for d in yaml.safe_load_all((bins / "lws-crds.yaml").read_text()) if d):
        try:
            ext.create_custom_resource_definition(crd)
        except client.ApiException as e:
            if e.status != 409:
                raise
        names.append(crd["metadata"]["name"])
    return names


def crds_established(api: Any, names: list[str]) -> bool:
    from kubernetes import client

    ext = client.ApiextensionsV1Api(api)
    for name in names:
        conditions = ext.read_custom_resource_definition(name).status.conditions or []
        if not any(c.type == "Established" and c.status == "True" for c in conditions):
            return False
    return True
