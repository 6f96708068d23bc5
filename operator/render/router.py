"""The router: its Deployment (Restricted pod security), its Service (the endpoint) and the
ServiceAccount/Role/RoleBinding it lists worker pods with. Pure."""

from __future__ import annotations

from typing import Any

from tandem.contracts.names import LABEL_ROLE, ROUTER_PORT
from tandem.contracts.runtimes import Runtime
from tandem.operator.config import OperatorConfig
from tandem.operator.render.config_files import ROUTER_SHUTDOWN_GRACE_S
from tandem.operator.render.identity import router_image_ref
from tandem.operator.render.objects import (
    CONFIG_DIR,
    Manifest,
    common_labels,
    config_mount,
    config_volume,
    deployment,
    metadata,
    names,
    pod_identity_env,
    pod_settings,
    resources,
    service,
)
from tandem.operator.render.trust import internal_secret_env
from tandem.operator.render.weights import router_weights_parts
from tandem.operator.spec import ROUTER, InferenceServiceSpec, Router

# A preStop pause before SIGTERM; then the router drains for up to ROUTER_SHUTDOWN_GRACE_S (rendered
# into its config). The pod's grace period covers both, with a margin.
ROUTER_PRESTOP_S = 5


def endpoint(name: str, namespace: str, spec: InferenceServiceSpec) -> str:
    """The in-cluster URL of the router Service."""
    return f"http://{names(name)[ROUTER]}.{namespace}.svc.cluster.local:{spec.router.service.port}"


def router_deployment(meta: dict, spec: InferenceServiceSpec, config: OperatorConfig,
                      config_hash: str) -> Manifest:
    """No GPU, Restricted pod security, reads pods through its own Role."""
    name = meta["name"]
    pod_labels = common_labels(name, ROUTER) | {LABEL_ROLE: ROUTER}
    return deployment(meta, ROUTER, spec.router.replicas, pod_labels, config_hash, router_pod(name, spec, config))


def router_pod(name: str, spec: InferenceServiceSpec, config: OperatorConfig) -> dict[str, Any]:
    """The router's pod spec (the gateway's picker runs the same pod: render/gateway.py)."""
    weights = router_weights(name, spec, config)
    return {
        **pod_settings(spec.router, names(name)[ROUTER]),
        "terminationGracePeriodSeconds": ROUTER_PRESTOP_S + ROUTER_SHUTDOWN_GRACE_S + 10,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **({"initContainers": weights[2]} if weights[2] else {}),
        "containers": [router_container(name, spec, config, weights[1])],
        "volumes": [config_volume(name, f"{ROUTER}.yaml"), {"name": "tmp", "emptyDir": {}}, *weights[0]],
    }


def router_weights(name: str, spec: InferenceServiceSpec, config: OperatorConfig
                   ) -> tuple[list[dict], list[dict], list[dict]]:
    """Runtime vllm: the model's folder read-only where the weights' delivery allows (its tokenizer
    files: vLLM's servers serve none, so the router tokenizes from them; router_config names the
    folder). Tandem's workers serve their tokenizer to the router: nothing to mount."""
    if spec.runtime.name is not Runtime.VLLM:
        return [], [], []
    return router_weights_parts(name, spec, config, router_image_ref(spec, config))


def router_container(name: str, spec: InferenceServiceSpec, config: OperatorConfig,
                     model_mounts: list[dict] | None = None) -> dict[str, Any]:
    router = spec.router
    image, pull_policy = router_image_ref(spec, config)
    amounts = {key: value for key, value in (("cpu", router.cpu), ("memory", router.memory))
               if value is not None}
    return {
        "name": "router",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["tandem", "router", "--config", f"{CONFIG_DIR}/config.yaml"],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": router_env(name, router),
        "resources": resources(amounts),
        "volumeMounts": [config_mount(), {"name": "tmp", "mountPath": "/tmp"}, *(model_mounts or ())],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        # Before SIGTERM: time for the endpoints to drop this pod, so no new request arrives after
        # the router starts draining (it lets streams in flight finish for shutdownGraceS).
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_S}}},
    }


def router_env(name: str, router: Router) -> list[dict[str, Any]]:
    """The pod's identity, the service's internal secret, and the API key from its Secret when one
    is named."""
    env = [*pod_identity_env(), internal_secret_env(name)]
    secret = router.api_key_secret_ref
    if secret is not None:
        env.append({
            "name": "TANDEM_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}},
        })
    return env


def router_service(meta: dict, spec: InferenceServiceSpec) -> Manifest:
    """The InferenceService's endpoint."""
    svc = spec.router.service
    return service(meta, ROUTER, svc.port, type=svc.type)


def router_rbac(meta: dict, spec: InferenceServiceSpec) -> list[Manifest]:
    """ServiceAccount + Role + RoleBinding: the router discovers workers by listing pods. With
    router.serviceAccountName the Role is bound to that account and none is created."""
    account = names(meta["name"])[ROUTER]
    subject = spec.router.service_account_name or account
    own = [] if spec.router.service_account_name else [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(meta, account, ROUTER)}]
    return [
        *own,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(meta, account, ROUTER),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                # discovery trusts a pod only through its owners: ReplicaSet -> Deployment -> us, or
                # (a group that spans nodes) StatefulSet -> LeaderWorkerSet -> us
                {"apiGroups": ["apps"], "resources": ["replicasets", "deployments", "statefulsets"],
                 "verbs": ["get"]},
                {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": ["get"]},
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(meta, account, ROUTER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": subject, "namespace": meta["namespace"]}],
        },
    ]
