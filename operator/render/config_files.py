"""The ConfigMap: one file per component, keys as `tandem worker` / `tandem router` read them. Pure.

Each pod mounts only its own file as config.yaml, and its pod template carries that file's hash,
so changing decode's engine settings rolls decode only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from tandem.contracts import timing
from tandem.contracts.handoff_parity import RECHECK_S
from tandem.contracts.names import KV_PORT, ROUTER_PORT, WORKER_PORT
from tandem.contracts.request_limits import MAX_OUTPUT_TOKENS
from tandem.contracts.runtimes import Runtime
from tandem.operator.render.objects import Manifest, metadata, names
from tandem.operator.render.runtimes.registry import role_renderer
from tandem.operator.render.weights import model_arg, router_model_dir
from tandem.operator.spec import ROUTER, WORKER_ROLES, InferenceServiceSpec
from tandem.operator.spec.inference_service import EXIT_MARGIN_S

KV_LEASE_S = int(timing.KV_LEASE_S)  # how long prefill keeps KV no decode worker has pulled (the worker's own default)


def drain_times(spec: InferenceServiceSpec, role: str) -> dict[str, int]:
    """drain_s and kv_lease_s within the pod's grace period: a pod being removed stays until every
    KV block it leased (a prefill's prompts; a decode pod's running sequences, which it hands to
    other decode pods on SIGTERM) is pulled or expired, then exits before the kubelet kills it."""
    drain = max(0, spec.role(role).termination_grace_period_seconds - EXIT_MARGIN_S)
    return {"drain_s": drain, "kv_lease_s": min(KV_LEASE_S, drain)}


def worker_config(name: str, role: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The `tandem` runtime's worker --config file: YAML keys mirror `tandem worker` flags
    (underscores)."""
    model, engine, kv = spec.model, spec.role(role).engine, spec.kv_transfer
    cfg: dict[str, Any] = {
        "role": role,
        "model": model_arg(spec),
        "served_name": model.served_name or name,
        "dtype": model.dtype,
        "max_model_len": model.max_model_len,
        "host": "0.0.0.0",
        "port": WORKER_PORT,
        "kv_backend": kv.backend,
        "kv_port": KV_PORT,  # the tcp backend's port, declared in the pod spec
        "block_size": kv.block_size,
        "max_num_seqs": engine.max_num_seqs,
        "max_batched_tokens": engine.max_batched_tokens,
        "prefix_caching": engine.prefix_caching,
        "log_format": "json",
        **drain_times(spec, role),
    }
    tensor = spec.role(role).parallelism.tensor
    if tensor > 1:
        # `tandem worker --tensor-parallel`: the group's ranks; a group that spans nodes finds its
        # share of them and its leader from the LeaderWorkerSet's LWS_* variables.
        cfg["tensor_parallel"] = tensor
    if engine.prefill_chunk_tokens is not None:
        cfg["prefill_chunk_tokens"] = engine.prefill_chunk_tokens
    if engine.kv_blocks is not None:
        cfg["num_blocks"] = engine.kv_blocks
    if engine.kv_memory_fraction is not None:
        cfg["kv_memory_fraction"] = engine.kv_memory_fraction
    return cfg


# How long a stopping router lets its streams in flight finish (the pod's grace period covers it).
ROUTER_SHUTDOWN_GRACE_S = 30


def router_config(name: str, namespace: str, spec: InferenceServiceSpec | Mapping) -> dict[str, Any]:
    """The router's --config file (keys of tandem.router.config.RouterConfig).

    The API key is not here: it reaches the router as $TANDEM_API_KEY from the Secret. A spec
    given as JSON is parsed first (the router's own tests pass one).
    """
    if not isinstance(spec, InferenceServiceSpec):
        spec = InferenceServiceSpec.from_dict(spec)
    router, model = spec.router, spec.model
    limits = router.limits
    no_limit = model.max_model_len - 1
    return {
        "host": "0.0.0.0",
        "port": ROUTER_PORT,
        "kubernetes": True,
        "namespace": namespace,
        "service": name,
        "worker_port": WORKER_PORT,
        "model": model.served_name or name,
        "policy": router.policy,
        "first_token": router.first_token,
        "short_prompt_threshold": router.short_prompt_tokens,
        "prefill_saturated_tokens": router.prefill_saturated_tokens,
        "decode_headroom_sequences": router.decode_headroom_sequences,
        "prefix_sequence_cost_tokens": router.prefix_sequence_cost_tokens,
        "max_prompt_tokens": no_limit if limits.max_prompt_tokens is None else limits.max_prompt_tokens,
        "max_tokens_limit": min(no_limit, MAX_OUTPUT_TOKENS) if limits.max_output_tokens is None
        else limits.max_output_tokens,
        "max_request_output_tokens": limits.max_request_output_tokens,
        "max_request_logprobs": limits.max_request_logprobs,
        "max_body_bytes": limits.max_body_bytes,
        "shutdown_grace_s": ROUTER_SHUTDOWN_GRACE_S,
        "parity_recheck_s": RECHECK_S,
        "log_format": "json",
        **flow_settings(router),
        **runtime_settings(spec),
    }


def flow_settings(router: Any) -> dict[str, Any]:
    """router.flowControl as the router's keys; nothing when it is off (the file stays as it was)."""
    flow = router.flow_control
    if not flow.max_concurrent_requests:
        return {}
    return {"max_concurrent_requests": flow.max_concurrent_requests, "flow_band_capacity": flow.band_capacity,
            "flow_ttl_s": flow.ttl_seconds, "flow_headroom": flow.headroom, "objectives": dict(flow.objectives or {})}


def runtime_settings(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The router's settings for a runtime other than tandem (none for tandem: its file stays as it
    was). vllm: the vLLM worker client; the tokenizer from the model's folder, which the router pod
    mounts (weights.router_model_dir: the CRD admits only deliveries it can mount), since vLLM's
    servers take token ids and serve no tokenizer. The parity probe runs as for tandem (it scores
    through vLLM's prompt_logprobs: router/parity/probe.py)."""
    if spec.runtime.name is not Runtime.VLLM:
        return {}
    return {"runtime": spec.runtime.name.value, "tokenizer": router_model_dir(spec) or "off"}


def dump(cfg: dict) -> str:
    return yaml.safe_dump(cfg, sort_keys=True)


def config_files(name: str, namespace: str, spec: InferenceServiceSpec,
                 runtime: str | None = None) -> dict[str, str]:
    """ConfigMap data: `<component>.yaml` per component, a worker role's from its runtime's renderer
    (None: spec.runtime.name's)."""
    renderer = role_renderer(runtime or spec.runtime.name)
    files = {f"{role}.yaml": dump(renderer.config_file(name, role, spec)) for role in WORKER_ROLES}
    return files | {f"{ROUTER}.yaml": dump(router_config(name, namespace, spec))}


def configmap(meta: dict, files: dict[str, str]) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(meta, names(meta["name"])["config"], "config"),
        "data": files,
    }
