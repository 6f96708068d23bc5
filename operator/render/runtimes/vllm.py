"""The `vllm` runtime's roles: vLLM's OpenAI server per worker, prefill and decode paired by vLLM's
NixlConnector, behind Tandem's router. Pure.

The container runs the launcher of the vLLM worker image, `tandem worker --runtime vllm --role R
--config /etc/tandem/config.yaml` (tandem.worker.vllm.launch), which turns the worker's settings into
`vllm serve` through tandem.contracts.vllm_serve (the served name, the context, the tensor-parallel
size, the role's NixlConnector, the KV events publisher, the block size of the platform) and applies
the CPU fixes before it execs vLLM; it logs the exact `vllm serve` line. The config file holds the
worker's settings (the keys `tandem worker` reads); the pod's args are the extra `vllm serve` flags,
one `--vllm-arg=` each: spec.<role>.engine's limits, then spec.runtime.args (last: on a repeated
flag vLLM takes the last).

A group spanning nodes is vLLM's multi-node launch without Ray, from the LeaderWorkerSet's
LWS_* variables as for Tandem's worker: the leader runs `--nnodes N --node-rank 0 --master-addr
$LWS_LEADER_ADDRESS` and serves; followers run `--node-rank $LWS_WORKER_INDEX --headless`, serve no
HTTP and so get no http port and no probes (the leader's /health answers only once every rank
joined, and the LeaderWorkerSet recreates the group when a pod dies).
"""

from __future__ import annotations

from typing import Any

from tandem.contracts.names import WORKER_PORT, WORKER_PORT_NAME, GroupMember
from tandem.contracts.vllm_serve import KV_EVENTS_PORT, NIXL_SIDE_CHANNEL_PORT, serve_env
from tandem.operator.config import OperatorConfig
from tandem.operator.render.config_files import drain_times
from tandem.operator.render.identity import image_ref
from tandem.operator.render.objects import CONFIG_DIR, config_mount
from tandem.operator.render.trust import KV_EVENTS_PORT_NAME, internal_secret_env
from tandem.operator.render.weights import model_arg
from tandem.operator.render.worker import security_context, worker_env, worker_resources
from tandem.operator.spec import InferenceServiceSpec, Parallelism

LAUNCHER = ["tandem", "worker", "--runtime", "vllm"]
NIXL_PORT_NAME = "nixl"  # vLLM's NIXL handshake (the side channel)
# vLLM's own API key check (`--api-key`, read from the environment): /v1/* wants the service's internal
# secret as `Authorization: Bearer`, the header Tandem's internal calls carry (contracts.internal_auth).
API_KEY_ENV = "VLLM_API_KEY"


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


def config_file(name: str, spec: InferenceServiceSpec, role: str) -> dict[str, Any]:
    """The launcher's settings (WorkerConfig keys, as `tandem worker --config` reads them): what it
    turns into `vllm serve`'s model, served name, dtype, context, port and tensor-parallel size, and
    the NIXL handshake's port (kv_port), and how long a SIGTERM lets its streams finish (drain_s:
    vLLM's --shutdown-timeout, within the pod's grace period)."""
    model, tensor = spec.model, spec.role(role).parallelism.tensor
    return {
        "role": role,
        "model": model_arg(spec),
        "served_name": model.served_name or name,
        "dtype": model.dtype,
        "max_model_len": model.max_model_len,
        "host": "0.0.0.0",
        "port": WORKER_PORT,
        "kv_port": NIXL_SIDE_CHANNEL_PORT,
        "log_format": "json",
        "drain_s": drain_times(spec, role)["drain_s"],
        **({"tensor_parallel": tensor} if tensor > 1 else {}),
    }


def vllm_args(spec: InferenceServiceSpec, role: str) -> list[str]:
    """The pod's args: each extra `vllm serve` argument as the launcher's `--vllm-arg=`."""
    return [f"--vllm-arg={a}" for a in (*engine_args(spec, role), *(spec.runtime.args or ()))]


def vllm_env(name: str, spec: InferenceServiceSpec, role: str, kv_compat: str) -> list[dict[str, Any]]:
    """Tandem's worker env (the pod's identity, the kv_compat, the internal secret, UCX/RDMA, the
    user's env last) with vLLM's: the NIXL side channel on the pod IP, the API key."""
    env = worker_env(name, spec, role, kv_compat)
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


class VllmRoleRenderer:
    def config_file(self, name: str, role: str, spec: InferenceServiceSpec) -> dict[str, Any]:
        return config_file(name, spec, role)

    def container(self, name: str, spec: InferenceServiceSpec, role: str, config: OperatorConfig,
                  kv_compat: str, model_mounts: list[dict]) -> dict[str, Any]:
        image, pull_policy = image_ref(spec, config)
        return {
            "name": "worker",
            "image": image,
            "imagePullPolicy": pull_policy,
            "command": [*LAUNCHER, "--role", role, "--config", f"{CONFIG_DIR}/config.yaml"],
            "args": vllm_args(spec, role),
            "ports": vllm_ports(),
            "env": vllm_env(name, spec, role, kv_compat),
            "resources": worker_resources(spec.role(role), spec.kv_transfer),
            "volumeMounts": [config_mount(), {"name": "dshm", "mountPath": "/dev/shm"}, *model_mounts],
            "securityContext": security_context(spec.kv_transfer),
            **vllm_probes(),
        }

    def group_member(self, pod: dict[str, Any], member: GroupMember, parallelism: Parallelism
                     ) -> dict[str, Any]:
        """The same pod for both (the launcher finds its node's rank from the LWS_* variables), but
        a follower is headless: no http port (nothing probes, scrapes or routes to it), no probes."""
        if member is GroupMember.LEADER:
            return pod
        container = pod["containers"][0]
        container["ports"] = [p for p in container["ports"] if p["name"] != WORKER_PORT_NAME]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            container.pop(probe, None)
        return pod
