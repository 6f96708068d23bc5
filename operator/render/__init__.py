"""InferenceService -> the manifests of its children. Pure: no I/O, no clock, no randomness.

`render` takes the typed spec (tandem.operator.spec, parsed from what the API server stored and
defaulted) and returns every child, all in the CR's namespace, in apply order:

  ConfigMap   <name>-config           engine config per role + router config   config_files.py
  PersistentVolumeClaim <name>-weights, Job <name>-weights-<hash>: a hub model's shared cache
                                      and its one download (model.cache.pvc)  weights.py
  ServiceAccount/Role/RoleBinding <name>-router: list/watch pods, EndpointSlices router.py
  Service     <name>-prefill/-decode  headless, for discovery                 worker.py
  Service     <name>-router           the endpoint                            router.py
  Deployment  <name>-prefill/-decode  the workers (GPU, RDMA, probes, spread)  worker.py
   or LeaderWorkerSet                 a role whose groups span nodes           group.py
  Deployment  <name>-router           the OpenAI-compatible router            router.py
  Service, Deployment <name>-picker, InferencePool <name>, HTTPRoute <name>: spec.gateway,
                                      and a sidecar in each decode pod        gateway.py
  NetworkPolicy <name>-workers        only the service's pods reach workers   trust.py
  PodDisruptionBudget <name>-<component>  a drain takes maxUnavailable at once  objects.py
  (Secret     <name>-internal         the router's and workers' shared secret: created once by
                                      apply.ensure_internal_secret, random, so not rendered here)

A new kind of child is one builder here plus its (apiVersion, kind) in apply.PATHS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.contracts.names import Role
from tandem.operator.config import OperatorConfig
from tandem.operator.render import gateway
from tandem.operator.render.config_files import (
    config_files,
    configmap,
    dump,
    router_config,
    worker_config,
)
from tandem.operator.render.group import LWS_API_VERSION, LWS_KIND, worker_group
from tandem.operator.render.identity import image_ref, kv_compat_hash, short_hash
from tandem.operator.render.objects import Manifest, disruption_budget, names
from tandem.operator.render.router import endpoint, router_deployment, router_rbac, router_service
from tandem.operator.render.trust import internal_secret, network_policy, with_secret_uid
from tandem.operator.render.weights import weights_children
from tandem.operator.render.worker import worker_deployment, worker_pod_spec, worker_service
from tandem.operator.spec import ROUTER, WORKER_ROLES, InferenceServiceSpec

__all__ = [
    "Manifest",
    "config_files",
    "endpoint",
    "kv_compat_hash",
    "image_ref",
    "internal_secret",
    "names",
    "render",
    "router_config",
    "stale_workloads",
    "worker_config",
]


def render(meta: dict, spec: InferenceServiceSpec, config: OperatorConfig,
           replicas: Mapping[str, int | None] | None = None, secret_uid: str | None = None,
           runtime: str | None = None) -> list[Manifest]:
    """Every child of one InferenceService, in apply order (config and RBAC before pods).

    `replicas` overrides a worker role's spec.<role>.replicas: the planner's count for an autoscaled
    role, or None to leave the field out (External mode: an HPA or KEDA owns it). `secret_uid` is the
    internal Secret's uid, annotated on every pod template: a Secret created again rolls the pods.
    `runtime` names the worker roles' renderer (runtimes/registry.py): their config files and
    containers; None (always, but in the seam's tests) takes spec.runtime.name.
    """
    runtime = runtime or spec.runtime.name
    counts = {role: spec.role(role).replicas for role in WORKER_ROLES} | dict(replicas or {})
    files = config_files(meta["name"], meta["namespace"], spec, runtime)
    if gateway.enabled(spec):  # the decode pods' sidecar reads a file of its own
        files[gateway.SIDECAR_CONFIG] = dump(gateway.sidecar_config(meta["name"], meta["namespace"], spec))
    # Each pod template carries the hash of its own file: a change rolls that component only.
    hashes = {key: short_hash(text, 16) for key, text in files.items()}
    if gateway.enabled(spec):
        hashes["decode.yaml"] = short_hash(files["decode.yaml"] + files[gateway.SIDECAR_CONFIG], 16)
    policy = [network_policy(meta, spec, config)] if spec.network_policy.enabled else []
    return with_secret_uid(secret_uid, [
        configmap(meta, files),
        *weights_children(meta, spec, config),
        *router_rbac(meta, spec),
        *(worker_service(meta, spec, role) for role in WORKER_ROLES),
        router_service(meta, spec),
        *policy,
        *(disruption_budget(meta, c, budget) for c, budget in _budgets(spec) if budget.enabled),
        *(worker_workload(meta, spec, role, config, hashes[f"{role}.yaml"], counts[role], runtime)
          for role in WORKER_ROLES),
        router_deployment(meta, spec, config, hashes[f"{ROUTER}.yaml"]),
        *gateway.gateway_children(meta, spec, config, hashes[f"{ROUTER}.yaml"]),
    ])


def _budgets(spec: InferenceServiceSpec) -> list[tuple[str, Any]]:
    return [(role, spec.role(role).pod_disruption_budget) for role in WORKER_ROLES] + [
        (ROUTER, spec.router.pod_disruption_budget)]


def worker_workload(meta: dict, spec: InferenceServiceSpec, role: str, config: OperatorConfig,
                    config_hash: str, replicas: int | None, runtime: str | None = None) -> Manifest:
    """A role's Deployment, or its LeaderWorkerSet when one worker's group spans nodes."""
    if not spec.role(role).parallelism.spans_nodes:
        made = worker_deployment(meta, spec, role, config, config_hash, replicas, runtime)
        if role == Role.DECODE.value and gateway.enabled(spec):
            template = made["spec"]["template"]
            template["spec"] = gateway.with_sidecar(template["spec"], meta["name"], spec, config)
        return made
    pod = worker_pod_spec(meta["name"], spec, role, config, kv_compat_hash(spec, config), runtime)
    return worker_group(meta, spec, role, config, config_hash, replicas, pod, runtime)


def stale_workloads(meta: dict, spec: InferenceServiceSpec) -> list[Manifest]:
    """Stubs of the workloads `render` no longer makes: per role, the kind it does not use now (the
    Deployment of a role whose groups span nodes, the LeaderWorkerSet of one that fits a node)."""
    stubs = []
    for role in WORKER_ROLES:
        api_version, kind = ((LWS_API_VERSION, LWS_KIND) if not spec.role(role).parallelism.spans_nodes
                             else ("apps/v1", "Deployment"))
        stubs.append({"apiVersion": api_version, "kind": kind,
                      "metadata": {"name": names(meta["name"])[role], "namespace": meta["namespace"]}})
    return stubs
