"""The InferenceService spec (tandem.dev/v1alpha1), declared once: typed, defaulted, validated.

Each field's line is its whole API: the JSON name, OpenAPI type (from the annotation), bounds,
enum, pattern, default and description. `InferenceServiceSpec.from_dict` parses what the API
server stored; `python -m tandem.operator.crd` writes the CRD's schema from these same lines.
Prefill and decode are one type, WorkerRole; what differs per role is said where it is used.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tandem.contracts.internal_auth import SECRET_ENV
from tandem.contracts.names import Role
from tandem.contracts.vllm_serve import BLOCK_SIZE, CPU_BLOCK_SIZE
from tandem.operator.spec.autoscaling import AutoscalingSpec
from tandem.operator.spec.fields import FreeForm, Quantity, Rule, api_field, parse, to_json
from tandem.operator.spec.gateway import GATEWAY_RULES, GatewaySpec
from tandem.operator.spec.model import Model, api_type
from tandem.operator.spec.parallelism import Parallelism, gpus_rule
from tandem.operator.spec.pod import (
    DisruptionBudget,
    Image,
    LocalObjectReference,
    image_pull_secrets,
    pod_disruption_budget,
    priority_class_name,
    runtime_class_name,
    service_account_name,
)
from tandem.operator.spec.router import Router
from tandem.operator.spec.runtime import RuntimeSpec

# Variables the operator sets in every worker itself; the CRD refuses them in a role's env.
RESERVED_ENV = ("POD_IP", "POD_NAME", "TANDEM_KV_COMPAT", SECRET_ENV)
# The worker roles an InferenceService runs (plain strings: they become labels and file names),
# and its components: each a Deployment with a readiness condition and replicas in status.
WORKER_ROLES: tuple[str, ...] = (Role.PREFILL.value, Role.DECODE.value)
ROUTER = "router"
COMPONENTS: tuple[str, ...] = (*WORKER_ROLES, ROUTER)
# A stopping worker drains (running sequences finish, leased KV gets pulled) for its grace period
# less EXIT_MARGIN_S, left for the process to exit before the kubelet's SIGKILL. Prefill's grace
# covers at least one whole KV pull (the worker's 10 s pull timeout) on top of that margin.
EXIT_MARGIN_S = 5
PREFILL_MIN_GRACE_S = EXIT_MARGIN_S + 10


@api_type
class Toleration:
    """A core/v1 Toleration for the pool's taints."""

    key: str | None = api_field("key", max_length=253)
    operator: str = api_field("operator", enum=["Exists", "Equal"], default="Equal")
    value: str | None = api_field("value", max_length=63)
    effect: str | None = api_field("effect", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"])
    toleration_seconds: int | None = api_field("tolerationSeconds", format="int64")

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("!(self.operator == 'Exists' && has(self.value))",
             "tolerations: a toleration with operator Exists must not set value"),
        Rule("self.operator == 'Exists' || has(self.key)",
             "tolerations: a toleration with operator Equal needs a key"),
    )


@api_type
class EnvVar:
    """One extra environment variable of a worker container (core/v1 EnvVar)."""

    name: str = api_field("name", max_length=128, pattern="^[A-Za-z_][A-Za-z0-9_.]*$")
    value: str | None = api_field("value", max_length=4096)
    value_from: FreeForm | None = api_field("valueFrom")

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("!(has(self.value) && has(self.valueFrom))", "env: set value or valueFrom, not both"),
        Rule("!(self.name in [" + ", ".join(f"'{n}'" for n in RESERVED_ENV) + "])",
             f"env: {', '.join(RESERVED_ENV[:-1])} and {RESERVED_ENV[-1]} are set by the operator "
             "and cannot be overridden"),
    )


@api_type
class Engine:
    """The engine limits of one role's workers (they land in that role's config file)."""

    max_batched_tokens: int = api_field(
        "maxBatchedTokens", minimum=1, maximum=1048576, default=8192,
        description="Tokens processed in one forward step.")
    max_num_seqs: int = api_field(
        "maxNumSeqs", minimum=1, maximum=4096, default=64, description="Sequences in the running batch.")
    prefill_chunk_tokens: int | None = api_field(
        "prefillChunkTokens", minimum=1, maximum=1048576,
        description="Prompt tokens one step may compute beside the running streams, which wait at most one such "
        "chunk per step (unset: the worker's default for the {role} role; `tandem plan` recommends one).")
    kv_blocks: int | None = api_field(
        "kvBlocks", minimum=1, maximum=16777216,
        description="KV cache size in blocks (instead of kvMemoryFraction).")
    kv_memory_fraction: float | None = api_field(
        "kvMemoryFraction", minimum=0, exclusive_minimum=True, maximum=1,
        description="Fraction of free accelerator memory for the KV cache (instead of kvBlocks).")
    prefix_caching: bool = api_field(
        "prefixCaching", default=True,
        description="Keep KV blocks after their request and reuse them for prompts that share a prefix "
        "(and, on decode, pull only what is not held already).")

    RULES: ClassVar[tuple[Rule, ...]] = (Rule("!(has(self.kvBlocks) && has(self.kvMemoryFraction))",
                            "{role}.engine: set kvBlocks or kvMemoryFraction, not both"),)


@api_type
class WorkerRole:
    """Prefill or decode: one pool of worker pods (`{role}` in a text becomes the role's name)."""

    replicas: int = api_field(
        "replicas", minimum=0, maximum=1000, default=1,
        description="Number of {role} workers (a worker is one pod, or a group of parallelism.nodes pods).")
    gpus: int = api_field(
        "gpus", minimum=0, maximum=16, default=1,
        description="nvidia.com/gpu per pod (0 runs on CPU): parallelism.tensor / parallelism.nodes.")
    parallelism: Parallelism = api_field(
        "parallelism", default={},
        description="Tensor parallelism of one {role} worker and the nodes its group spans (replicas count "
        "groups).")
    cpu: Quantity | None = api_field("cpu", description="CPU request and limit per pod, e.g. 4 or 3500m.")
    memory: Quantity | None = api_field("memory", description="Memory request and limit per pod, e.g. 64Gi.")
    shm_size: Quantity = api_field(
        "shmSize", default="1Gi", description="Size limit of the memory-backed /dev/shm.")
    node_selector: dict[str, str] | None = api_field(
        "nodeSelector", max_properties=32, values={"maxLength": 63},
        description="Node labels the pods must match (the node pool).")
    tolerations: tuple[Toleration, ...] | None = api_field(
        "tolerations", max_items=32,
        description="Tolerations for the pool's taints (GPU nodes usually carry nvidia.com/gpu:NoSchedule).")
    affinity: FreeForm | None = api_field(
        "affinity", description="A core/v1 Affinity, passed to the pods as is.")
    env: tuple[EnvVar, ...] | None = api_field(
        "env", max_items=64,
        extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Extra environment variables for the worker container (they win over the operator's "
        "UCX settings).")
    engine: Engine = api_field("engine", default={}, description="Engine limits of this role's workers.")
    termination_grace_period_seconds: int = api_field(
        "terminationGracePeriodSeconds", minimum=0, maximum=86400, default=60,
        description="Time a stopping worker gets to finish its requests.")
    # Pod settings a platform needs (spec/pod.py).
    priority_class_name: str | None = priority_class_name()
    runtime_class_name: str | None = runtime_class_name()
    image_pull_secrets: tuple[LocalObjectReference, ...] | None = image_pull_secrets()
    service_account_name: str | None = service_account_name(
        "ServiceAccount of the {role} pods (it must exist), e.g. one a cloud maps to an identity that may read "
        "the weights. Its token is not mounted: workers never call the Kubernetes API.")
    pod_disruption_budget: DisruptionBudget = pod_disruption_budget()

    RULES: ClassVar[tuple[Rule, ...]] = (gpus_rule(),)


def _role(role: Role, description: str, **overrides: dict[str, Any]) -> Any:
    """spec.prefill / spec.decode: a WorkerRole named `role`, with that role's own defaults."""
    return api_field(role.value, default={}, description=description, context={"role": role.value},
                     overrides=overrides)


@api_type
class UCX:
    """UCX settings of the nixl backend: they become the workers' UCX_* environment."""

    transports: str | None = api_field(
        "transports", max_length=256, pattern=r"^\^?[a-z0-9_]+(,[a-z0-9_]+)*$",
        description="UCX_TLS, e.g. rc_x,rc,dc_x,dc,cuda_copy,cuda_ipc or tcp.")
    net_devices: str | None = api_field(
        "netDevices", max_length=256, pattern="^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$",
        description="UCX_NET_DEVICES, e.g. mlx5_0:1 or all.")
    env: dict[str, str] | None = api_field(
        "env", max_properties=32, values={"maxLength": 256},
        description="Extra UCX_/NCCL_ variables, e.g. UCX_IB_ADDR_TYPE: eth for RoCE.",
        rules=(Rule("self.all(k, k.startsWith('UCX_') || k.startsWith('NCCL_'))",
                    "kvTransfer.ucx.env: keys must be UCX_* or NCCL_* variable names"),))


@api_type
class RDMA:
    """The RDMA device-plugin resource each worker pod requests."""

    resource_name: str = api_field(
        "resourceName", max_length=253,
        pattern="^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="e.g. rdma/rdma_shared_device_a, rdma/ib, nvidia.com/hostdev.")
    count: int = api_field(
        "count", minimum=0, maximum=64, default=1, description="Units of resourceName per pod.")

    RULES: ClassVar[tuple[Rule, ...]] = (Rule(
        "self.count > 0",
        "kvTransfer.rdma.count must be greater than 0 when kvTransfer.rdma.resourceName is set "
        "(remove kvTransfer.rdma to run without RDMA)"),)


@api_type
class KVTransfer:
    """How prefill hands the KV cache to decode."""

    backend: str = api_field(
        "backend", enum=["nixl", "tcp"], default="nixl", description="nixl (UCX: RDMA or TCP) or plain tcp.")
    block_size: int = api_field(
        "blockSize", enum=[8, 16, 32, 64, 128], default=16,
        description="Tokens per KV block (prefill and decode must agree).")
    ucx: UCX | None = api_field("ucx", description="UCX settings for the nixl backend.")
    rdma: RDMA | None = api_field(
        "rdma", description="The RDMA device-plugin resource each worker pod requests.")
    host_network: bool = api_field(
        "hostNetwork", default=False,
        description="Run workers in the node's network namespace (for RDMA without a secondary network).")
    ipc_lock: bool = api_field(
        "ipcLock", default=False,
        description="Add the IPC_LOCK capability (pinning memory for RDMA registration).")
    min_bandwidth_gbps: float | None = api_field(
        "minBandwidthGBps", minimum=0, exclusive_minimum=True, maximum=10000,
        description="The slowest KV handoff bandwidth (GB/s, over a worker's recent transfers) that counts "
        "as working: KVTransferReady turns False (BandwidthBelowFloor) when a worker measures less, e.g. "
        "NIXL/UCX fallen back to TCP. Unset: not judged.")

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("!(has(self.hostNetwork) && self.hostNetwork) || has(self.rdma)",
             "kvTransfer.hostNetwork is only allowed together with kvTransfer.rdma"),
        Rule("!has(self.backend) || self.backend == 'nixl' || !has(self.rdma)",
             "kvTransfer.rdma needs kvTransfer.backend nixl; the tcp backend does not use RDMA"),
        Rule("!has(self.backend) || self.backend == 'nixl' || !has(self.ucx)",
             "kvTransfer.ucx applies only to kvTransfer.backend nixl"),
    )


@api_type
class NetworkPolicySpec:
    """Who may reach the worker pods: the operator renders one NetworkPolicy per InferenceService."""

    enabled: bool = api_field(
        "enabled", default=True,
        description="Render the NetworkPolicy: worker ports reachable only from this service's router and "
        "workers, and the operator (its KV probe and metrics reads).")
    metrics_from: tuple[FreeForm, ...] | None = api_field(
        "metricsFrom", max_items=16,
        description="NetworkPolicyPeers also allowed to the workers' http port, e.g. Prometheus "
        "(/metrics). The internal API on that port still needs the service's secret.")


def _vllm_rule(rule: str, message: str) -> Rule:
    """What runtime vllm cannot honour: refused at apply rather than silently ignored. (A CRD that
    lacks these rules lacks spec.runtime too, so the parser needs no twin.)"""
    return Rule(f"!has(self.runtime) || self.runtime.name != 'vllm' || ({rule})", message)


def _no_engine_field(field: str) -> str:
    return f"!has(self.prefill.engine.{field}) && !has(self.decode.engine.{field})"


VLLM_RULES = (
    _vllm_rule("!has(self.image)", "spec.image is Tandem's own worker image: with runtime vllm set runtime.image"),
    _vllm_rule("has(self.model.pvc) || has(self.model.image) || (has(self.model.hub) && has(self.model.cache) && "
               "has(self.model.cache.pvc))",
               "runtime vllm: the router tokenizes with the model's own files (vLLM serves none), so its pod mounts "
               "the weights read-only: deliver them as model.pvc, model.image, or model.hub with model.cache.pvc "
               "(a router cannot read model.path inside the worker image, a node's model.hostPath under the "
               "Restricted pod security level, or a hub model each worker pod downloads for itself)"),
    _vllm_rule("self.kvTransfer.backend == 'nixl'",
               "runtime vllm hands KV over with vLLM's NixlConnector: kvTransfer.backend must be nixl"),
    _vllm_rule(f"self.kvTransfer.blockSize == {BLOCK_SIZE}",
               f"with runtime vllm the KV block size is the platform's ({BLOCK_SIZE} tokens on a GPU, "
               f"{CPU_BLOCK_SIZE} on a CPU, where vLLM's attention takes no less): leave kvTransfer.blockSize "
               f"at its default {BLOCK_SIZE}"),
    _vllm_rule("!has(self.kvTransfer.minBandwidthGBps)",
               "kvTransfer.minBandwidthGBps is judged from Tandem workers' KV health reports, which vLLM "
               "servers do not give: remove it with runtime vllm"),
    _vllm_rule(_no_engine_field("kvMemoryFraction"),
               "engine.kvMemoryFraction is Tandem's share of free memory for the KV cache; vLLM sizes its cache "
               "from --gpu-memory-utilization (the whole instance's share of the GPU): set that in "
               "runtime.args instead"),
    _vllm_rule(_no_engine_field("prefillChunkTokens"),
               "engine.prefillChunkTokens is Tandem's; vLLM chunks prompts by --max-num-batched-tokens "
               "(engine.maxBatchedTokens) and --long-prefill-token-threshold (runtime.args)"),
)


@api_type
class InferenceServiceSpec:
    """One served model, prefill and decode disaggregated: the whole `spec` of an InferenceService."""

    model: Model = api_field(
        "model", description="The served model: where the weights are (exactly one of path, hostPath, pvc, "
        "hub) and how to load them.")
    prefill: WorkerRole = _role(
        Role.PREFILL, "The prefill workers (read the whole prompt, compute-bound). Same shape as decode.",
        terminationGracePeriodSeconds={
            "default": 120,
            "constraints": {"minimum": PREFILL_MIN_GRACE_S, "maximum": 86400},
            "description": "Time a stopping worker gets to finish its requests and hand off its KV blocks "
            f"(its KV leases last at most this less {EXIT_MARGIN_S} s, so a pod being removed stays until "
            "every block it leased is pulled or expired).",
        })
    decode: WorkerRole = _role(
        Role.DECODE, "The decode workers (one token per step, memory-bound). Same shape as prefill.")
    kv_transfer: KVTransfer = api_field(
        "kvTransfer", default={}, description="How prefill hands the KV cache to decode.")
    router: Router = api_field(
        "router", default={}, description="The OpenAI-compatible router: the service's endpoint.",
        context={"role": ROUTER})
    image: Image | None = api_field(
        "image", description="The Tandem worker image (prefill and decode); unset fields come from the "
        "operator's configuration. A tag set here also pins the router's image tag unless router.image sets "
        "one.")
    runtime: RuntimeSpec = api_field(
        "runtime", default={}, description="The engine the workers run: Tandem's own (default) or vLLM "
        "(docs/runtimes.md).")
    network_policy: NetworkPolicySpec = api_field(
        "networkPolicy", default={}, description="Who may reach the worker pods.")
    gateway: GatewaySpec = api_field(
        "gateway", default={}, description="Behind a gateway of the Gateway API Inference Extension: an "
        "InferencePool and Tandem's endpoint picker (docs/gateway.md).")
    autoscaling: AutoscalingSpec | None = api_field(
        "autoscaling", description="Scale prefill and decode apart against latency targets (the operator's "
        "planner, or an external autoscaler per role). A role left out keeps its fixed replicas.")

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("!has(self.router.limits.maxPromptTokens) || self.router.limits.maxPromptTokens < "
             "self.model.maxModelLen",
             "router.limits.maxPromptTokens must be below model.maxModelLen (room for at least one "
             "output token)"),
        Rule("!has(self.router.limits.maxOutputTokens) || self.router.limits.maxOutputTokens < "
             "self.model.maxModelLen",
             "router.limits.maxOutputTokens must be below model.maxModelLen"),
        Rule("!has(self.kvTransfer.rdma) || (self.prefill.gpus > 0 && self.decode.gpus > 0)",
             "kvTransfer.rdma needs GPU workers: prefill.gpus and decode.gpus must be at least 1"),
        *VLLM_RULES,
        *GATEWAY_RULES,
    )

    @classmethod
    def from_dict(cls, value: Any) -> InferenceServiceSpec:
        """The stored spec (defaulted by the API server, or not: declared defaults fill gaps).

        Raises SpecError naming the field when the spec breaks a declared type or constraint.
        """
        return parse(cls, value, "spec")

    def to_dict(self) -> dict[str, Any]:
        """Back to JSON, with every declared default present (what the API server stores)."""
        return to_json(self)

    def role(self, role: Role | str) -> WorkerRole:
        """spec.prefill or spec.decode by role name."""
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode}[Role(role)]

    def replicas(self) -> dict[str, int]:
        """Desired pods per component: what the Deployments get and status reports."""
        return {Role.PREFILL.value: self.prefill.replicas, Role.DECODE.value: self.decode.replicas,
                ROUTER: self.router.replicas}
