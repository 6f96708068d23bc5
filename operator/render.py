"""InferenceService -> the manifests of its children. Pure: no I/O, no clock, no randomness.

The spec it receives has been defaulted by the API server from the CRD's OpenAPI defaults,
so required-with-default fields are read directly. Children, all in the CR's namespace:

  ConfigMap   <name>-config          engine config per role + router config
  Deployment  <name>-prefill/-decode the workers (GPU, RDMA, probes, spread across nodes)
  Service     <name>-prefill/-decode headless, for discovery
  Deployment  <name>-router          the OpenAI-compatible router (Restricted pod security)
  Service     <name>-router          the endpoint
  ServiceAccount/Role/RoleBinding <name>-router: list/watch pods and EndpointSlices
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml
from tandem.contracts.names import (
    ANNOTATION_CONFIG_HASH,
    API_VERSION,
    KIND,
    LABEL_COMPONENT,
    LABEL_GENERATION,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_ROLE,
    LABEL_SERVICE,
    MANAGED_BY,
    ROUTER_PORT,
    WORKER_PORT,
)
from tandem.operator.config import OperatorConfig

WORKER_ROLES = ("prefill", "decode")
CONFIG_DIR = "/etc/tandem"
MODEL_DIR = "/models"
HF_CACHE_DIR = "/cache"
GPU_RESOURCE = "nvidia.com/gpu"
# Variables the operator sets itself; the CRD refuses them in a role's env.
RESERVED_ENV = ("POD_NAME", "POD_IP", "TANDEM_GENERATION")

Manifest = dict[str, Any]


def names(name: str) -> dict[str, str]:
    """Child object names, one place for the renderer, status and tests."""
    return {
        "config": f"{name}-config",
        "prefill": f"{name}-prefill",
        "decode": f"{name}-decode",
        "router": f"{name}-router",
    }


def endpoint(name: str, namespace: str, spec: dict) -> str:
    """The in-cluster URL of the router Service."""
    return f"http://{names(name)['router']}.{namespace}.svc.cluster.local:{spec['router']['service']['port']}"


def image_ref(spec: dict, config: OperatorConfig) -> tuple[str, str]:
    """(image, pullPolicy): the CR's image fields, each falling back to the operator's default."""
    image = spec.get("image") or {}
    repo = image.get("repository") or config.image_repository
    tag = image.get("tag") or config.image_tag
    if tag.startswith("@"):
        ref = repo + tag
    elif tag.startswith("sha256:"):
        ref = f"{repo}@{tag}"
    else:
        ref = f"{repo}:{tag}"
    return ref, image.get("pullPolicy") or config.pull_policy


def short_hash(obj: Any, length: int = 10) -> str:
    """Stable short hash of a JSON-able value (sorted keys), for labels and annotations."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def generation_hash(spec: dict, config: OperatorConfig) -> str:
    """tandem.dev/generation: what must match for a prefill worker to hand KV to a decode worker."""
    model = spec["model"]
    return short_hash(
        {
            "source": {k: model.get(k) for k in ("path", "hostPath", "pvc", "hub")},
            "dtype": model["dtype"],
            "maxModelLen": model["maxModelLen"],
            "backend": spec["kvTransfer"]["backend"],
            "blockSize": spec["kvTransfer"]["blockSize"],
            "image": image_ref(spec, config)[0],
        }
    )


def model_arg(spec: dict) -> str:
    """What the worker's --model gets: a path inside the container or a hub id."""
    model = spec["model"]
    if "path" in model:
        return model["path"]
    if "hub" in model:
        return model["hub"]
    return MODEL_DIR  # hostPath and pvc are mounted here


def worker_config(name: str, role: str, spec: dict) -> dict[str, Any]:
    """The worker's --config file: YAML keys mirror `tandem worker` flags (underscores)."""
    model, engine = spec["model"], spec[role]["engine"]
    cfg: dict[str, Any] = {
        "role": role,
        "model": model_arg(spec),
        "served_name": model.get("servedName") or name,
        "dtype": model["dtype"],
        "max_model_len": model["maxModelLen"],
        "host": "0.0.0.0",
        "port": WORKER_PORT,
        "kv_backend": spec["kvTransfer"]["backend"],
        "block_size": spec["kvTransfer"]["blockSize"],
        "max_num_seqs": engine["maxNumSeqs"],
        "max_batched_tokens": engine["maxBatchedTokens"],
        "log_format": "json",
    }
    if "kvBlocks" in engine:
        cfg["num_blocks"] = engine["kvBlocks"]
    if "kvMemoryFraction" in engine:
        cfg["kv_memory_fraction"] = engine["kvMemoryFraction"]
    return cfg


def router_config(name: str, namespace: str, spec: dict) -> dict[str, Any]:
    """The router's --config file (keys of tandem.worker.router.config.RouterConfig).

    The API key is not here: it reaches the router as $TANDEM_API_KEY from the Secret.
    """
    router, model = spec["router"], spec["model"]
    limits = router["limits"]
    return {
        "host": "0.0.0.0",
        "port": ROUTER_PORT,
        "kubernetes": True,
        "namespace": namespace,
        "service": name,
        "worker_port": WORKER_PORT,
        "model": model.get("servedName") or name,
        "policy": router["policy"],
        "short_prompt_threshold": router["shortPromptTokens"],
        "max_prompt_tokens": limits.get("maxPromptTokens", model["maxModelLen"] - 1),
        "max_tokens_limit": limits.get("maxOutputTokens", model["maxModelLen"] - 1),
        "max_body_bytes": limits["maxBodyBytes"],
        "log_format": "json",
    }


def _dump(cfg: dict) -> str:
    return yaml.safe_dump(cfg, sort_keys=True)


def config_files(name: str, namespace: str, spec: dict) -> dict[str, str]:
    """ConfigMap data: one file per role; each pod mounts its own as config.yaml."""
    return {
        "prefill.yaml": _dump(worker_config(name, "prefill", spec)),
        "decode.yaml": _dump(worker_config(name, "decode", spec)),
        "router.yaml": _dump(router_config(name, namespace, spec)),
    }


def selector_labels(name: str, role: str) -> dict[str, str]:
    """A role's Deployment selector: immutable, so it never includes the generation."""
    return {LABEL_SERVICE: name, LABEL_ROLE: role}


def common_labels(name: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "tandem",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_SERVICE: name,
    }


def owner_reference(meta: dict) -> dict[str, Any]:
    """controller=true so the garbage collector deletes children with the CR."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(meta: dict, name: str, component: str, extra: dict | None = None) -> dict:
    labels = common_labels(meta["name"], component) | (extra or {})
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(meta)],
    }


def _resources(role_spec: dict, spec: dict) -> dict[str, dict[str, Any]]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    for key in ("cpu", "memory"):
        if role_spec.get(key) is not None:
            requests[key] = limits[key] = str(role_spec[key])
    if role_spec["gpus"] > 0:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(role_spec["gpus"])
    rdma = spec["kvTransfer"].get("rdma")
    if rdma:
        requests[rdma["resourceName"]] = limits[rdma["resourceName"]] = str(rdma["count"])
    out: dict[str, dict[str, Any]] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _worker_env(name: str, role: str, spec: dict, generation: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        # The KV transfer side channel advertises the pod IP.
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "TANDEM_GENERATION", "value": generation},
        {"name": "TANDEM_SERVICE", "value": name},
    ]
    kv = spec["kvTransfer"]
    if kv["backend"] == "nixl":
        ucx = kv.get("ucx") or {}
        if ucx.get("transports"):
            env.append({"name": "UCX_TLS", "value": ucx["transports"]})
        if ucx.get("netDevices"):
            env.append({"name": "UCX_NET_DEVICES", "value": ucx["netDevices"]})
        for key in sorted(ucx.get("env") or {}):
            env.append({"name": key, "value": ucx["env"][key]})
    if "hub" in spec["model"]:
        env.append({"name": "HF_HOME", "value": f"{HF_CACHE_DIR}/huggingface"})
    # The user's env last: it may tune UCX further; reserved names are refused by the CRD.
    env += [dict(item) for item in spec[role].get("env") or [] if item["name"] not in RESERVED_ENV]
    # One entry per name (server-side apply refuses duplicates): a later setting wins in place.
    unique: dict[str, dict[str, Any]] = {}
    for item in env:
        unique[item["name"]] = item
    return list(unique.values())


def _model_volume(spec: dict) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) for the weights: read-only; an in-image path or a hub id needs none."""
    model = spec["model"]
    if "pvc" in model:
        volume = {
            "name": "model",
            "persistentVolumeClaim": {"claimName": model["pvc"]["claimName"], "readOnly": True},
        }
        mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
        if model["pvc"].get("subPath"):
            mount["subPath"] = model["pvc"]["subPath"]
        return [volume], [mount]
    if "hostPath" in model:
        volume = {"name": "model", "hostPath": {"path": model["hostPath"], "type": "Directory"}}
        return [volume], [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}]
    if "hub" in model:
        return [{"name": "hf-cache", "emptyDir": {}}], [
            {"name": "hf-cache", "mountPath": HF_CACHE_DIR}
        ]
    return [], []


def _probes() -> dict[str, Any]:
    """Model loading is budgeted by the startupProbe (one hour); then liveness/readiness take over."""

    def get(path: str) -> dict:
        return {"httpGet": {"path": path, "port": "http"}}

    return {
        "startupProbe": get("/ready") | {"periodSeconds": 30, "failureThreshold": 120, "timeoutSeconds": 5},
        "livenessProbe": get("/health") | {"periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5},
        "readinessProbe": get("/ready") | {"periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 5},
    }


def worker_deployment(
    meta: dict, spec: dict, role: str, config: OperatorConfig, config_hash: str
) -> Manifest:
    """The prefill or decode Deployment: a production GPU worker pod."""
    name = meta["name"]
    role_spec, kv = spec[role], spec["kvTransfer"]
    generation = generation_hash(spec, config)
    image, pull_policy = image_ref(spec, config)
    model_volumes, model_mounts = _model_volume(spec)

    security: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if kv["ipcLock"]:
        # Pinning memory for RDMA registration. A capability only takes effect for uid 0
        # (Kubernetes sets no ambient capabilities), so this pod runs as root: it needs a
        # namespace at the privileged Pod Security level anyway.
        security["capabilities"]["add"] = ["IPC_LOCK"]
        security["runAsUser"] = 0
        security["runAsNonRoot"] = False
    else:
        security["runAsNonRoot"] = True  # the image's user (uid 10001): Restricted level
    container: dict[str, Any] = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["tandem", "worker", "--role", role, "--config", f"{CONFIG_DIR}/config.yaml"],
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "env": _worker_env(name, role, spec, generation),
        "resources": _resources(role_spec, spec),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *model_mounts,
        ],
        "securityContext": security,
        **_probes(),
    }
    pod_labels = common_labels(name, role) | {LABEL_ROLE: role, LABEL_GENERATION: generation}
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # workers never talk to the API server
        "terminationGracePeriodSeconds": role_spec["terminationGracePeriodSeconds"],
        "containers": [container],
        "volumes": [
            {
                "name": "config",
                "configMap": {
                    "name": names(name)["config"],
                    "items": [{"key": f"{role}.yaml", "path": "config.yaml"}],
                },
            },
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(role_spec["shmSize"])}},
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
    if role_spec.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(role_spec["nodeSelector"])
    if role_spec.get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in role_spec["tolerations"]]
    if role_spec.get("affinity"):
        pod_spec["affinity"] = role_spec["affinity"]
    if kv["hostNetwork"]:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"

    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(meta, names(name)[role], role, {LABEL_ROLE: role}),
        "spec": {
            "replicas": role_spec["replicas"],
            "selector": {"matchLabels": selector_labels(name, role)},
            # Never below the desired capacity during a rollout: new pods come up before old go.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": 3600,
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {ANNOTATION_CONFIG_HASH: config_hash},
                },
                "spec": pod_spec,
            },
        },
    }


def worker_service(meta: dict, role: str) -> Manifest:
    """Headless Service per worker role: DNS records for discovery, no load balancing."""
    name = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta, names(name)[role], role, {LABEL_ROLE: role}),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(name, role),
            "ports": [{"name": "http", "port": WORKER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_deployment(meta: dict, spec: dict, config: OperatorConfig, config_hash: str) -> Manifest:
    """The router Deployment: no GPU, Restricted pod security, reads pods through its own Role."""
    name = meta["name"]
    router = spec["router"]
    image, pull_policy = image_ref(spec, config)
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    secret = router.get("apiKeySecretRef")
    if secret:
        env.append(
            {
                "name": "TANDEM_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}},
            }
        )
    resources: dict[str, Any] = {}
    for key in ("cpu", "memory"):
        if router.get(key) is not None:
            resources.setdefault("requests", {})[key] = str(router[key])
            resources.setdefault("limits", {})[key] = str(router[key])
    container: dict[str, Any] = {
        "name": "router",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["tandem", "router", "--config", f"{CONFIG_DIR}/config.yaml"],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(meta, names(name)["router"], "router", {LABEL_ROLE: "router"}),
        "spec": {
            "replicas": router["replicas"],
            "selector": {"matchLabels": selector_labels(name, "router")},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": common_labels(name, "router") | {LABEL_ROLE: "router"},
                    "annotations": {ANNOTATION_CONFIG_HASH: config_hash},
                },
                "spec": {
                    "serviceAccountName": names(name)["router"],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 10001,
                        "runAsGroup": 10001,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "config",
                            "configMap": {
                                "name": names(name)["config"],
                                "items": [{"key": "router.yaml", "path": "config.yaml"}],
                            },
                        },
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def router_service(meta: dict, spec: dict) -> Manifest:
    """The InferenceService's endpoint."""
    name = meta["name"]
    svc = spec["router"]["service"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta, names(name)["router"], "router", {LABEL_ROLE: "router"}),
        "spec": {
            "type": svc["type"],
            "selector": selector_labels(name, "router"),
            "ports": [{"name": "http", "port": svc["port"], "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_rbac(meta: dict) -> list[Manifest]:
    """ServiceAccount + Role + RoleBinding: the router discovers workers by listing pods."""
    name = meta["name"]
    sa = names(name)["router"]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _metadata(meta, sa, "router"),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(meta, sa, "router"),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
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
            "metadata": _metadata(meta, sa, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": meta["namespace"]}],
        },
    ]


def render(meta: dict, spec: dict, config: OperatorConfig) -> list[Manifest]:
    """Every child of one InferenceService, in apply order (config and RBAC before pods)."""
    name, namespace = meta["name"], meta["namespace"]
    files = config_files(name, namespace, spec)
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(meta, names(name)["config"], "config"),
        "data": files,
    }
    hashes = {role: short_hash(files[f"{role}.yaml"], 16) for role in (*WORKER_ROLES, "router")}
    return [
        configmap,
        *router_rbac(meta),
        worker_service(meta, "prefill"),
        worker_service(meta, "decode"),
        router_service(meta, spec),
        worker_deployment(meta, spec, "prefill", config, hashes["prefill"]),
        worker_deployment(meta, spec, "decode", config, hashes["decode"]),
        router_deployment(meta, spec, config, hashes["router"]),
    ]
