"""The `vllm` runtime's roles: vLLM's OpenAI server per worker, prefill and decode paired by vLLM's
NixlConnector, behind Tandem's router. Pure.

The container runs the launcher of the vLLM worker image, `tandem worker --runtime vllm --role R --`,
with the `vllm serve` arguments as the pod's `args`, exactly as contracts.vllm_serve renders them
(the model folder first, then the served name, host and port, the tensor-parallel size, the fixed
block size, the KV connector of the role, the KV events publisher), then spec.<role>.engine's limits
as vLLM flags, then spec.runtime.args (last: on a repeated flag vLLM takes the last). The launcher
(tandem.worker.vllm) runs `vllm serve` with them, adding only what a CPU platform needs, so
`kubectl get pod -o yaml` shows what runs.

A group spanning nodes is vLLM's multi-node launch without Ray: the leader runs
`--nnodes N --node-rank 0 --master-addr $(LWS_LEADER_ADDRESS)` and serves; followers run
`--node-rank $(LWS_WORKER_INDEX) --headless`, serve no HTTP and have no probes (the leader's /health
answers only once every rank joined, and the LeaderWorkerSet recreates the group when a pod dies).
"""

from __future__ import annotations

from typing import Any

from tandem.contracts.names import (
    LWS_LEADER_ADDRESS_ENV,
    LWS_WORKER_INDEX_ENV,
    WORKER_PORT,
    WORKER_PORT_NAME,
    GroupMember,
)
from tandem.contracts.vllm_serve import (
    KV_EVENTS_PORT,
    NIXL_SIDE_CHANNEL_PORT,
    VLLM_VERSION,
    GroupPlace,
    ServeOptions,
    serve_args,
    serve_env,
)
from tandem.operator.config import OperatorConfig
from tandem.operator.render.config_files import drain_times
from tandem.operator.render.identity import image_ref
from tandem.operator.render.objects import config_mount
from tandem.operator.render.trust import KV_EVENTS_PORT_NAME, internal_secret_env
from tandem.operator.render.weights import model_arg
from tandem.operator.render.worker import security_context, worker_env, worker_resources
from tandem.operator.spec import InferenceServiceSpec, Parallelism

LAUNCHER = ["tandem", "worker", "--runtime", "vllm"]
NIXL_PORT_NAME = "nixl"  # vLLM's NIXL handshake (the side channel)
# vLLM's own API key check (`--api-key`, read from the environment): /v1/* wants the service's internal
# secret as `Authorization: Bearer`, the header Tandem's internal calls carry (contracts.internal_auth).
API_KEY_ENV = "VLLM_API_KEY"
NODE_RANK, MASTER_PORT_FLAG, HEADLESS = "--node-rank", "--master-port", "--headless"


def engine_args(spec: InferenceServiceSpec, role: str) -> list[str]:
    """spec.<role>.engine as vLLM flags (kvMemoryFraction and prefillChunkTokens are refused by the CRD
    with runtime vllm: vLLM has no flag that means the same)."""
    engine = spec.role(role).engine
    args = ["--max-num-seqs", str(engine.max_num_seqs), "--max-num-batched-tokens", str(engine.max_batched_tokens)]
    if not engine.prefix_caching:
        args.append("--no-enable-prefix-caching")
    if engine.kv_blocks is not None:
        args += ["--num-gpu-blocks-override", str(engine.kv_blocks)]
    return args


def serve_options(name: str, spec: InferenceServiceSpec, role: str) -> ServeOptions:
    """One role's `vllm serve`, as contracts.vllm_serve takes it (a group's leader where the group
    spans nodes: group_member turns it into a follower's)."""
    role_spec, model = spec.role(role), spec.model
    par = role_spec.parallelism
    group = (GroupPlace(par.nodes, 0, f"$({LWS_LEADER_ADDRESS_ENV})") if par.spans_nodes else None)
    return ServeOptions(
        model=model_arg(spec), served_name=model.served_name or name, role=role, port=WORKER_PORT,
        max_model_len=model.max_model_len, tensor=par.tensor,
        dtype=None if model.dtype == "auto" else model.dtype,
        # KV stays in host memory on a CPU pod; on a GPU NIXL reads it from the GPU (vLLM's default).
        kv_buffer_device="cpu" if role_spec.gpus == 0 else None,
        kv_events_port=KV_EVENTS_PORT, group=group,
        extra=[*engine_args(spec, role), *(spec.runtime.args or ())])


def vllm_env(name: str, spec: InferenceServiceSpec, role: str, generation: str) -> list[dict[str, Any]]:
    """Tandem's worker env (the pod's identity, the generation, the internal secret, UCX/RDMA, the
    user's env last) with vLLM's: the NIXL side channel on the pod IP, the API key."""
    env = worker_env(name, spec, role, generation)
    user = [e for e in env if e["name"] in {v.name for v in spec.role(role).env or ()}]
    own = [e for e in env if e not in user]
    side = serve_env(side_channel_port=NIXL_SIDE_CHANNEL_PORT)
    own += [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *({"name": k, "value": v} for k, v in side.items()),
            {"name": API_KEY_ENV, "valueFrom": internal_secret_env(name)["valueFrom"]}]
    unique: dict[str, dict[str, Any]] = {}
    for item in own + user:  # the user's last, as for tandem
        unique[item["name"]] = item
    return list(unique.values())


def vllm_ports() -> list[dict[str, Any]]:
    return [{"name": WORKER_PORT_NAME, "containerPort": WORKER_PORT, "protocol": "TCP"},
            {"name": NIXL_PORT_NAME, "containerPort": NIXL_SIDE_CHANNEL_PORT, "protocol": "TCP"},
            {"name": KV_EVENTS_PORT_NAME, "containerPort": KV_EVENTS_PORT, "protocol": "TCP"}]


def vllm_probes() -> dict[str, Any]:
    """vLLM's /health (200 once the engine serves; /v1/* wants the API key): the startupProbe budgets
    the model load (one hour), as for Tandem's workers."""
    def health(period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": "/health", "port": WORKER_PORT_NAME}, "periodSeconds": period,
                "failureThreshold": failures, "timeoutSeconds": 5}

    return {"startupProbe": health(30, 120), "livenessProbe": health(10, 3), "readinessProbe": health(5, 2)}


def follower_args(leader: list[str]) -> list[str]:
    """A follower's arguments from its leader's: its own rank (from LeaderWorkerSet), headless."""
    args = list(leader)
    args[args.index(NODE_RANK) + 1] = f"$({LWS_WORKER_INDEX_ENV})"
    at = args.index(MASTER_PORT_FLAG) + 2
    return [*args[:at], HEADLESS, *args[at:]]


class VllmRoleRenderer:
    def config_file(self, name: str, role: str, spec: InferenceServiceSpec) -> dict[str, Any]:
        """The role's `vllm serve` arguments again, for a reader of the ConfigMap (the pod's args are
        what runs); its hash rolls the role when they change."""
        return {"runtime": "vllm", "role": role, "vllm_version": VLLM_VERSION,
                "serve_args": serve_args(serve_options(name, spec, role)), **drain_times(spec, role)}

    def container(self, name: str, spec: InferenceServiceSpec, role: str, config: OperatorConfig,
                  generation: str, model_mounts: list[dict]) -> dict[str, Any]:
        image, pull_policy = image_ref(spec, config)
        return {
            "name": "worker",
            "image": image,
            "imagePullPolicy": pull_policy,
            "command": [*LAUNCHER, "--role", role, "--"],
            "args": serve_args(serve_options(name, spec, role)),
            "ports": vllm_ports(),
            "env": vllm_env(name, spec, role, generation),
            "resources": worker_resources(spec.role(role), spec.kv_transfer),
            "volumeMounts": [config_mount(), {"name": "dshm", "mountPath": "/dev/shm"}, *model_mounts],
            "securityContext": security_context(spec.kv_transfer),
            **vllm_probes(),
        }

    def group_member(self, pod: dict[str, Any], member: GroupMember, parallelism: Parallelism
                     ) -> dict[str, Any]:
        if member is GroupMember.LEADER:
            return pod
        container = pod["containers"][0]
        container["args"] = follower_args(container["args"])
        # Headless: no API server, so no http port (nothing scrapes or probes a follower) and no probes.
        container["ports"] = [p for p in container["ports"] if p["name"] != WORKER_PORT_NAME]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            container.pop(probe, None)
        return pod
