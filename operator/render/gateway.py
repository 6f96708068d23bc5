"""`spec.gateway`: Tandem behind a gateway of the Gateway API Inference Extension. Pure.

  InferencePool <name>                the decode pods, at their sidecar's port, picked by the picker
  Deployment/Service <name>-picker    Tandem's router serving ext_proc (gRPC) and its health
  HTTPRoute <name>                    every path of the parentRefs' Gateways to the pool (when named)
  a sidecar in each decode pod        the OpenAI API there (`tandem router --gateway-decode`): it
                                      prefills on the worker the picker named, found by DNS

The InferencePool and HTTPRoute kinds are the gateway's (its Inference Extension CRDs): Tandem's
chart does not install them, and applying them where they are missing fails with a message that
says so (api_client.missing_kind_hint). The picker is the router's container with the ext_proc port
and gRPC probes; it runs as the router's ServiceAccount (it lists the same pods).
"""

from __future__ import annotations

from typing import Any

from tandem.contracts import gateway
from tandem.contracts.names import LABEL_ROLE, ROUTER_PORT, WORKER_PORT, Role
from tandem.operator.config import OperatorConfig
from tandem.operator.render.config_files import router_config
from tandem.operator.render.objects import (
    Manifest,
    common_labels,
    component_object,
    deployment,
    metadata,
    names,
    selector_labels,
)
from tandem.operator.render.router import router_container, router_pod
from tandem.operator.spec import InferenceServiceSpec

PICKER = gateway.PICKER
SIDECAR = gateway.SIDECAR_PORT_NAME  # the decode pod's sidecar container, and its port's name
SIDECAR_CONFIG = "sidecar.yaml"
SIDECAR_CONFIG_DIR = "/etc/tandem/gateway"
INFERENCE_API = f"{gateway.INFERENCE_GROUP}/{gateway.INFERENCE_VERSION}"
POOL_KIND = "InferencePool"
ROUTE_API = "gateway.networking.k8s.io/v1"


def enabled(spec: InferenceServiceSpec) -> bool:
    return spec.gateway.enabled


def sidecar_config(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The decode pods' sidecar: the router's settings, but its own worker as decode and the prefill
    workers by DNS (the headless prefill Service: ready pods only), no API access, no parity probe (the
    picker proves the pairings it names)."""
    cfg = router_config(name, namespace, spec)
    for key in ("kubernetes", "namespace", "service"):
        cfg.pop(key, None)
    return cfg | {
        "port": gateway.SIDECAR_PORT,
        "gateway_decode": f"http://127.0.0.1:{WORKER_PORT}",
        "prefill_dns": f"{names(name)[Role.PREFILL.value]}.{namespace}.svc:{WORKER_PORT}",
        "parity_probe": False,
    }


def sidecar_container(name: str, spec: InferenceServiceSpec, config: OperatorConfig) -> dict[str, Any]:
    """The router's container as a decode pod's sidecar: its own file, port and probes."""
    container = router_container(name, spec, config)  # runtime tandem only (CEL): no model mounts
    container.pop("lifecycle", None)
    container.update({
        "name": SIDECAR,
        "command": ["tandem", "router", "--config", f"{SIDECAR_CONFIG_DIR}/config.yaml"],
        "ports": [{"name": SIDECAR, "containerPort": gateway.SIDECAR_PORT, "protocol": "TCP"}],
        "volumeMounts": [{"name": "gateway-config", "mountPath": SIDECAR_CONFIG_DIR, "readOnly": True},
                         {"name": "gateway-tmp", "mountPath": "/tmp"}],
        "livenessProbe": {"httpGet": {"path": "/health", "port": SIDECAR}, "periodSeconds": 10},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": SIDECAR}, "periodSeconds": 5},
    })
    return container


def with_sidecar(pod: dict[str, Any], name: str, spec: InferenceServiceSpec, config: OperatorConfig) -> dict[str, Any]:
    """A decode pod with the gateway's sidecar (its config file and scratch space)."""
    pod = dict(pod)
    pod["containers"] = [*pod["containers"], sidecar_container(name, spec, config)]
    pod["volumes"] = [
        *pod["volumes"],
        {"name": "gateway-config", "configMap": {"name": names(name)["config"],
                                                 "items": [{"key": SIDECAR_CONFIG, "path": "config.yaml"}]}},
        {"name": "gateway-tmp", "emptyDir": {}},
    ]
    return pod


def picker_deployment(meta: dict, spec: InferenceServiceSpec, config: OperatorConfig, config_hash: str) -> Manifest:
    """The router's pod serving ext_proc on the picker port; ready (gRPC health `readiness`) while it can
    route, live while it answers (`liveness`); the router's ServiceAccount (it discovers the same pods)."""
    pod = router_pod(meta["name"], spec, config)
    container = pod["containers"][0]
    container.update({
        "name": PICKER,
        "command": [*container["command"], "--ext-proc-port", str(gateway.PICKER_PORT),
                    "--gateway-port", str(gateway.SIDECAR_PORT)],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": gateway.PICKER_PORT, "protocol": "TCP"}],
        "livenessProbe": {"grpc": {"port": gateway.PICKER_PORT, "service": gateway.HEALTH_LIVENESS},
                          "periodSeconds": 10},
        "readinessProbe": {"grpc": {"port": gateway.PICKER_PORT, "service": gateway.HEALTH_READINESS},
                           "periodSeconds": 5},
    })
    container.pop("lifecycle", None)
    labels = common_labels(meta["name"], PICKER) | {LABEL_ROLE: PICKER}
    return deployment(meta, PICKER, spec.gateway.picker_replicas, labels, config_hash, pod)


def picker_service(meta: dict) -> Manifest:
    """The picker's gRPC port, as the pool's endpointPickerRef names it (h2c)."""
    return component_object(meta, PICKER, "v1", "Service", {
        "selector": selector_labels(meta["name"], PICKER),
        "ports": [{"name": "grpc", "port": gateway.PICKER_PORT, "targetPort": "grpc", "protocol": "TCP",
                   "appProtocol": "kubernetes.io/h2c"}],
    })


def inference_pool(meta: dict, spec: InferenceServiceSpec) -> Manifest:
    """The decode pods (no LeaderWorkerSet follower) at their sidecar's port, picked by the picker."""
    name = meta["name"]
    return {
        "apiVersion": INFERENCE_API,
        "kind": POOL_KIND,
        "metadata": metadata(meta, name, "pool"),
        "spec": {
            "selector": {"matchLabels": {**selector_labels(name, Role.DECODE.value), LABEL_ROLE: Role.DECODE.value}},
            "targetPorts": [{"number": gateway.SIDECAR_PORT}],
            "endpointPickerRef": {"name": names(name)[PICKER], "port": {"number": gateway.PICKER_PORT},
                                  "failureMode": spec.gateway.failure_mode},
        },
    }


def http_route(meta: dict, spec: InferenceServiceSpec) -> list[Manifest]:
    """Every path of the named Gateways to the pool (none named: no route)."""
    refs = spec.gateway.parent_refs
    if not refs:
        return []
    parents = [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": r.name,
                **({"namespace": r.namespace} if r.namespace else {}),
                **({"sectionName": r.section_name} if r.section_name else {})} for r in refs]
    return [{
        "apiVersion": ROUTE_API,
        "kind": "HTTPRoute",
        "metadata": metadata(meta, meta["name"], "route"),
        "spec": {
            "parentRefs": parents,
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": gateway.INFERENCE_GROUP, "kind": POOL_KIND, "name": meta["name"]}],
            }],
        },
    }]


def gateway_children(meta: dict, spec: InferenceServiceSpec, config: OperatorConfig,
                     config_hash: str) -> list[Manifest]:
    """What `spec.gateway` adds after everything else: the picker and its Service, the pool, the route."""
    if not enabled(spec):
        return []
    return [picker_service(meta), picker_deployment(meta, spec, config, config_hash),
            inference_pool(meta, spec), *http_route(meta, spec)]
