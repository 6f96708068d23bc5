"""A vLLM server's identity and load as the router's WorkerInfo, pure: read from its Prometheus text
(GET /metrics) and its model list (GET /v1/models).

Load: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0..1),
summed (fractions averaged) over the server's engines. vLLM exports no count of queued prompt
tokens: outstanding_prompt_tokens is 0, and the router's own count of the prompts it sent and has
not seen start (workers.py) is what load-aware disaggregation weighs. Identity: the process start
time (`process_start_time_seconds`) names the engine, so a restarted server is a new engine; the
KV cache's dtype from `vllm:cache_config_info` ("" while it is vLLM's `auto`: the model's own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tandem.contracts.names import Role
from tandem.contracts.protocol import WorkerInfo

RUNNING, WAITING, KV_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
CACHE_INFO, STARTED = "vllm:cache_config_info", "process_start_time_seconds"
_WANTED = (RUNNING, WAITING, KV_USAGE, CACHE_INFO, STARTED)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# vLLM's names for a KV cache dtype -> the names WorkerInfo.dtype uses (router/parity/decisions.py)
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16",
           "float32": "float32", "float": "float32", "fp32": "float32"}


@dataclass
class Metrics:
    """What the router reads of one /metrics answer."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    started: str = ""  # process_start_time_seconds as written: the engine's identity
    labels: dict[str, str] = field(default_factory=dict)  # of vllm:cache_config_info

    def block_size(self, default: int) -> int:
        """The KV block size the server runs (its KV events name blocks of this many tokens)."""
        value = self.labels.get("block_size", "")
        return int(value) if value.isdigit() and int(value) > 0 else default


def parse_metrics(text: str) -> Metrics:
    """The series the router reads, from Prometheus's text format; ValueError without vLLM's series."""
    m, usages, seen = Metrics(), [], False
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        if name == STARTED:
            m.started = value
        elif name == CACHE_INFO:
            m.labels = dict(_LABEL.findall(head))
        elif name == RUNNING:
            seen = True
            m.running += int(float(value))
        elif name == WAITING:
            m.waiting += int(float(value))
        elif name == KV_USAGE:
            usages.append(float(value))
    if not seen:
        raise ValueError("no vllm:num_requests_running in /metrics: not a vLLM server")
    m.kv_usage = min(1.0, max(0.0, sum(usages) / len(usages))) if usages else 0.0
    return m


def parse_models(body: Any) -> tuple[str, int]:
    """(served model name, max_model_len) from /v1/models; ValueError when it lists none."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ValueError("/v1/models lists no model")
    first = data[0]
    length = first.get("max_model_len")
    return str(first["id"]), int(length) if isinstance(length, int) else 0


def worker_info(m: Metrics, model: str, max_model_len: int, engine_id: str, role: Role, ready: bool,
                tokenizer_sha256: str) -> WorkerInfo:
    dtype = _DTYPES.get(m.labels.get("cache_dtype", "auto"), "")
    return WorkerInfo(
        role=role, model=model, max_model_len=max_model_len, engine_id=engine_id, kv_compat="",
        kv_backend="nixl" if role in (Role.PREFILL, Role.DECODE) else "", ready=ready, running=m.running,
        waiting=m.waiting, kv_usage=m.kv_usage, outstanding_prompt_tokens=0, tokenizer_sha256=tokenizer_sha256,
        dtype=dtype)
