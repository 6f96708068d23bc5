"""The prefill and decode workers: a production GPU pod, its Deployment and headless Service. Pure.

The pod spec is built from pieces, one per concern: the container (image, command, env,
resources, probes, security), the volumes (config, /dev/shm, model weights) and placement
(node pool, spread, host network).
"""

from __future__ import annotations

from typing import Any

from tandem.contracts.names import (
    KV_PORT,
    KV_PORT_NAME,
    LABEL_KV_COMPAT,
    LABEL_ROLE,
    WORKER_PORT,
    WORKER_PORT_NAME,
    KVBackend,
    Role,
)
from tandem.operator.config import OperatorConfig
from tandem.operator.render.identity import image_ref, kv_compat_hash
from tandem.operator.render.objects import (
    CONFIG_DIR,
    Manifest,
    common_labels,
    config_mount,
    config_volume,
    deployment,
    pod_identity_env,
    pod_settings,
    resources,
    selector_labels,
    service,
)
from tandem.operator.render.runtimes.registry import role_renderer
from tandem.operator.render.trust import internal_secret_env
from tandem.operator.render.weights import weights_pod_parts
from tandem.operator.spec import (
    RESERVED_ENV,
    InferenceServiceSpec,
    KVTransfer,
    WorkerRole,
    to_json,
)

GPU_RESOURCE = "nvidia.com/gpu"


def worker_deployment(meta: dict, spec: InferenceServiceSpec, role: str, config: OperatorConfig,
                      config_hash: str, replicas: int | None, runtime: str | None = None) -> Manifest:
    """The prefill or decode Deployment: never below the desired capacity during a rollout.
    `replicas` None leaves the field out (an external autoscaler owns it)."""
    kv_compat = kv_compat_hash(spec, config)
    pod_labels = common_labels(meta["name"], role) | {LABEL_ROLE: role, LABEL_KV_COMPAT: kv_compat}
    # New pods come up before old ones go: a rollout needs room for one more pod in the pool.
    rollout = {
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "progressDeadlineSeconds": 3600,
    }
    pod = worker_pod_spec(meta["name"], spec, role, config, kv_compat, runtime)
    return deployment(meta, role, replicas, pod_labels, config_hash, pod, rollout)


def worker_service(meta: dict, spec: InferenceServiceSpec, role: str) -> Manifest:
    """Headless Service per worker role: DNS records for discovery, no load balancing.

    For a role whose groups span nodes it is also the pods' subdomain (the LeaderWorkerSet's name):
    followers find their leader by its DNS name before any pod is Ready, so it publishes them all.
    """
    head: dict[str, Any] = {"clusterIP": "None"}
    if spec.role(role).parallelism.spans_nodes:
        head["publishNotReadyAddresses"] = True
    return service(meta, role, WORKER_PORT, **head)


def worker_pod_spec(name: str, spec: InferenceServiceSpec, role: str, config: OperatorConfig,
                    kv_compat: str, runtime: str | None = None) -> dict[str, Any]:
    """A worker pod: its container is the runtime's (runtimes/; None: spec.runtime.name's), the rest
    every runtime's."""
    role_spec = spec.role(role)
    model_volumes, model_mounts, init_containers = weights_pod_parts(name, spec, config)
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # workers never talk to the API server
        "terminationGracePeriodSeconds": role_spec.termination_grace_period_seconds,
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [role_renderer(runtime or spec.runtime.name).container(name, spec, role, config, kv_compat,
                                                                            model_mounts)],
        "volumes": [
            config_volume(name, f"{role}.yaml"),
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": role_spec.shm_size}},
            *model_volumes,
        ],
        # Spread a role's replicas across nodes; soft, so a small pool still fills.
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector_labels(name, role)},
                "matchLabelKeys": ["pod-template-hash"],
            }
        ],
    }
    return pod | placement(role_spec, spec.kv_transfer) | pod_settings(role_spec)


def worker_container(name: str, spec: InferenceServiceSpec, role: str, config: OperatorConfig,
                     kv_compat: str, model_mounts: list[dict]) -> dict[str, Any]:
    image, pull_policy = image_ref(spec, config)
    return {
        "name": "worker",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["tandem", "worker", "--role", role, "--config", f"{CONFIG_DIR}/config.yaml"],
        "ports": worker_ports(spec, role),
        "env": worker_env(name, spec, role, kv_compat),
        "resources": worker_resources(spec.role(role), spec.kv_transfer),
        "volumeMounts": [config_mount(), {"name": "dshm", "mountPath": "/dev/shm"}, *model_mounts],
        "securityContext": security_context(spec.kv_transfer),
        **probes(),
    }


def worker_ports(spec: InferenceServiceSpec, role: str) -> list[dict[str, Any]]:
    """http (internal API, probes, metrics); a worker of the tcp backend also serves KV (prefill: its
    prompts' KV; decode: its running sequences' when it migrates them out on SIGTERM)."""
    ports = [{"name": WORKER_PORT_NAME, "containerPort": WORKER_PORT, "protocol": "TCP"}]
    if spec.kv_transfer.backend == KVBackend.TCP and role in (Role.PREFILL, Role.DECODE):
        ports.append({"name": KV_PORT_NAME, "containerPort": KV_PORT, "protocol": "TCP"})
    return ports


def security_context(kv: KVTransfer) -> dict[str, Any]:
    """Restricted, unless RDMA needs IPC_LOCK."""
    security: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if kv.ipc_lock:
        # Pinning memory for RDMA registration. A capability only takes effect for uid 0
        # (Kubernetes sets no ambient capabilities), so this pod runs as root: it needs a
        # namespace at the privileged Pod Security level anyway.
        security["capabilities"]["add"] = ["IPC_LOCK"]
        security["runAsUser"] = 0
        security["runAsNonRoot"] = False
    else:
        security["runAsNonRoot"] = True  # the image's user (uid 10001): Restricted level
    return security


def worker_resources(role_spec: WorkerRole, kv: KVTransfer) -> dict[str, dict[str, str]]:
    amounts = {key: value for key, value in (("cpu", role_spec.cpu), ("memory", role_spec.memory))
               if value is not None}
    if role_spec.gpus > 0:
        amounts[GPU_RESOURCE] = str(role_spec.gpus)
    if kv.rdma is not None:
        amounts[kv.rdma.resource_name] = str(kv.rdma.count)
    return resources(amounts)


def worker_env(name: str, spec: InferenceServiceSpec, role: str, kv_compat: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        *pod_identity_env(),
        # The KV transfer side channel advertises the pod IP.
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "TANDEM_KV_COMPAT", "value": kv_compat},
        {"name": "TANDEM_SERVICE", "value": name},
        internal_secret_env(name),
    ]
    ucx = spec.kv_transfer.ucx
    if spec.kv_transfer.backend == KVBackend.NIXL and ucx is not None:
        if ucx.transports:
            env.append({"name": "UCX_TLS", "value": ucx.transports})
        if ucx.net_devices:
            env.append({"name": "UCX_NET_DEVICES", "value": ucx.net_devices})
        env += [{"name": key, "value": ucx.env[key]} for key in sorted(ucx.env or {})]
    if spec.model.hub is not None:
        # The weights are on disk before the worker starts (tandem.operator.render.weights).
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    # The user's env last: it may tune UCX further; reserved names are refused by the CRD.
    env += [to_json(item) for item in spec.role(role).env or () if item.name not in RESERVED_ENV]
    # One entry per name (server-side apply refuses duplicates): a later setting wins in place.
    unique: dict[str, dict[str, Any]] = {}
    for item in env:
        unique[item["name"]] = item
    return list(unique.values())


def probes() -> dict[str, Any]:
    """Model loading is budgeted by the startupProbe (one hour); then liveness/readiness take over."""

    def get(path: str) -> dict:
        return {"httpGet": {"path": path, "port": "http"}}

    return {
        "startupProbe": get("/ready") | {"periodSeconds": 30, "failureThreshold": 120, "timeoutSeconds": 5},
        "livenessProbe": get("/health") | {"periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5},
        "readinessProbe": get("/ready") | {"periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 5},
    }


def placement(role_spec: WorkerRole, kv: KVTransfer) -> dict[str, Any]:
    """The pod's node pool (selector, tolerations, affinity) and host networking for RDMA."""
    out: dict[str, Any] = {}
    if role_spec.node_selector:
        out["nodeSelector"] = dict(role_spec.node_selector)
    if role_spec.tolerations:
        out["tolerations"] = [to_json(t) for t in role_spec.tolerations]
    if role_spec.affinity:
        out["affinity"] = role_spec.affinity
    if kv.host_network:
        out["hostNetwork"] = True
        out["dnsPolicy"] = "ClusterFirstWithHostNet"
    return out
