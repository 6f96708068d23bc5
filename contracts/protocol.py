"""The internal HTTP protocol between the router and the workers, and between workers.

One source of truth for what crosses a process boundary on the data plane; the pieces with an idea
of their own live beside it: sampling.py (SamplingParams, TokenLogprobs, their bounds), kv_source.py
(KVSource, KVRank), tokenizer_files.py (TokenizerFiles) and kv_events.py (KVEventMessage).
None of them imports torch: the router uses them too.

Endpoints every worker serves (aiohttp, see worker/server/):

  GET  /health                  200 while the process is alive
  GET  /ready                   200 once the model is loaded and the KV agent is up, else 503
  GET  /v1/models               OpenAI list with the served model name
  GET  /metrics                 Prometheus text
  GET  /internal/info           WorkerInfo (role, epoch, limits, load), for the router
  POST /internal/generate       GenerateRequest -> NDJSON stream of StreamEvent lines
                                (decode and colocated roles; with `kv_source` set, the
                                decode worker pulls the KV from the prefill worker, or from
                                the decode worker a migrated sequence leaves, first;
                                `generated_token_ids` are replayed, never streamed again)
  POST /internal/prefill        GenerateRequest -> PrefillResult JSON (prefill and colocated roles);
                                the KV blocks stay leased on the prefill worker until pulled,
                                released or expired
  POST /internal/abort          {"request_id", "lease_token"?}: cancel the request here; its KV
                                lease (prefill side) is freed only when lease_token proves it
  GET  /internal/kv/metadata    the KV agent's metadata (backend, engine_id, epoch, layout, ...)
  POST /internal/kv/release     {"request_id", "lease_token"}: the prefill side frees a request's
                                leased blocks (a wrong token or a second release frees nothing)
  POST /internal/kv/check       {"request_id", "lease_token", "block_ids"} -> {"ok"}: may these blocks
                                be read under that lease? Asked by the worker's own tensor-parallel
                                ranks before they serve a read (the leases live on rank 0)
  GET  /internal/kv/health      KV transfer health (also in /internal/info: the routers pass it on
                                to the operator, for KVTransferReady)
  GET  /internal/tokenizer      TokenizerFiles: the served model's tokenizer and chat template, so
                                the router tokenizes as the workers do without a model volume
                                (WorkerInfo.tokenizer_sha256 names them; equal digests, equal files)
  GET  /internal/kv/events      NDJSON stream of KVEventMessage: a SNAPSHOT of every prefix-cache
                                block hash the worker holds, then UPDATEs (stored, removed) numbered
                                one by one, and HEARTBEATs; a gap in `seq` means events were lost,
                                so the reader reconnects and starts again from a new snapshot

With a per-service secret configured (tandem.contracts.internal_auth), every /internal/*
endpoint except /internal/kv/health wants `Authorization: Bearer <secret>` and answers 401
otherwise.

Every request carries the router's request id in the `X-Request-Id` header and
in the body. Errors are HTTP 4xx/5xx with an OpenAI-format body
({"error": {"message", "type", "param", "code"}}); the router passes 4xx bodies
through to the client unchanged.

A request id is unique on a worker: one that is running, queued, leased or being
pulled there gets 409 `duplicate_request_id`. A worker that is alive but full says
so with Retry-After, which callers treat as busy, never as a dead worker: 429
`queue_full` (more requests would wait than its queue allows), 429
`prefill_queue_timeout` (a prefill that could not start in time), 503
`kv_cache_full` (no blocks to receive a handoff's KV), 503 `draining` (shutting down: it takes
no new request). A worker whose engine
thread died or stalls answers 503 `engine_unhealthy` and fails /health.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.contracts.kv_health import KVHealth
from tandem.contracts.kv_source import KVSource
from tandem.contracts.names import Role
from tandem.contracts.sampling import SamplingParams

REQUEST_ID_HEADER = "X-Request-Id"
NDJSON = "application/x-ndjson"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the client or the router
    ERROR = "error"


class EventType(enum.StrEnum):
    START = "start"  # first line of a stream: prompt_tokens
    TOKEN = "token"  # one or more new tokens with their text delta
    FINISH = "finish"  # last line on success: finish_reason and usage
    ERROR = "error"  # last line on failure: an OpenAI-format error object
    # Keep-alive: sent whenever the worker has had nothing to say for its heartbeat interval (the
    # request waits in its queue, or a step is slow). The router's between-line timeout starts
    # again at every line, so a request that waits is never taken for a hung worker.
    HEARTBEAT = "heartbeat"
    # Last line when the worker is shutting down (SIGTERM) and hands the sequence out instead of
    # finishing it: `kv` (its KV leased here, as a prefill result's is: prompt + generated[:-1]
    # tokens; None when it had none yet) and `generated_token_ids` (every token so far). The router
    # continues it on another decode worker, pulling that KV, or recomputing without it.
    MIGRATE = "migrate"



MAX_CACHE_SALT_CHARS = 256  # GenerateRequest.cache_salt
MAX_FAIRNESS_ID_CHARS = 256  # GenerateRequest.fairness_id


@dataclass
class GenerateRequest:
    request_id: str
    # Exactly one of prompt / messages / prompt_token_ids. A router that loaded the workers'
    # tokenizer (GET /internal/tokenizer) sends token ids; else the worker tokenizes (and applies
    # the chat template to messages).
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # How `messages` go through the chat template (chat_options.py): add_generation_prompt,
    # continue_final_message, chat_template_kwargs; None: the defaults (a generation prompt added).
    chat_options: dict[str, Any] | None = None
    # Disaggregated decode: the prompt's KV is pulled from here; generated_token_ids then holds
    # exactly the prefill worker's first token.
    kv_source: KVSource | None = None
    # Tokens this request already generated elsewhere: the prefill worker's first token on a KV
    # handoff, every token so far on a resume after a failure. The worker replays them through
    # its detokenizer and stop rules (so it holds exactly the state of the worker that produced
    # them) and streams only what follows; it never sends them again. max_tokens counts them.
    generated_token_ids: list[int] = field(default_factory=list)
    # Characters of generated text the client already has. The worker streams text from there, so
    # text the previous worker held back (a partial UTF-8 character, a possible stop string) is
    # neither lost nor repeated. None: what a stream carrying those tokens would have sent.
    emitted_chars: int | None = None
    # Older spelling of generated_token_ids=[first_token_id] on a KV handoff.
    first_token_id: int | None = None
    # Set by the router when kv_source is a migrated sequence's (the URL of the decode worker it
    # leaves): counted and logged apart from prefill handoffs.
    migrated_from: str | None = None
    # A tenant's salt for the prefix cache (vLLM's `cache_salt`): mixed into the names of the
    # request's KV blocks (tandem.contracts.prefix.request_salt), so a request reuses cached KV only
    # of requests with the same salt, and no tenant can time another's prompts by their cache hits.
    # None: shared with every unsalted request. At most MAX_CACHE_SALT_CHARS characters.
    cache_salt: str | None = None
    # The request's flow at the router's flow control (flow_control.py): its tenant (the fairness id,
    # at most MAX_FAIRNESS_ID_CHARS) and its priority. A worker's scheduler gives its prompt chunks
    # to the highest priority first, then to the tenant it has served the fewest tokens lately (scheduler.py).
    fairness_id: str | None = None
    priority: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The wire form, sharing this request's lists (dataclasses.asdict copied a long prompt's ids
        one by one: 9% of a router's CPU under a flood of 400-token prompts)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["sampling"] = self.sampling.to_wire()
        if self.kv_source is not None:
            d["kv_source"] = dataclasses.asdict(self.kv_source)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerateRequest:
        d = dict(d)
        d["sampling"] = SamplingParams(**(d.get("sampling") or {}))
        if d.get("kv_source") is not None:
            d["kv_source"] = KVSource(**d["kv_source"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class PrefillResult:
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    first_token_text: str
    # Set when the first token already ends the request (EOS, stop, max_tokens=1):
    # then there is nothing to hand off and the prefill worker has freed the blocks.
    finish_reason: FinishReason | None
    kv: KVSource | None
    # The first token's logprobs (TokenLogprobs.to_wire) when sampling.logprobs asked for them.
    first_token_logprobs: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillResult:
        d = dict(d)
        if d.get("kv") is not None:
            d["kv"] = KVSource(**d["kv"])
        if d.get("finish_reason") is not None:
            d["finish_reason"] = FinishReason(d["finish_reason"])
        return cls(**d)


@dataclass
class StreamEvent:
    """One NDJSON line of /internal/generate."""

    type: EventType
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # detokenized delta for token_ids (may lag a token on partial UTF-8)
    prompt_tokens: int | None = None  # on START
    finish_reason: FinishReason | None = None  # on FINISH
    usage: dict[str, int] | None = None  # on FINISH: prompt_tokens, completion_tokens
    error: dict[str, Any] | None = None  # on ERROR: {"message", "type", "param", "code"}
    kv: KVSource | None = None  # on MIGRATE: where the sequence's KV is leased, if it had any
    generated_token_ids: list[int] = field(default_factory=list)  # on MIGRATE: every token so far
    # on TOKEN, when sampling.logprobs asked: one TokenLogprobs.to_wire per token id
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, [], "")} | {
            "type": self.type.value
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamEvent:
        d = dict(d)
        d["type"] = EventType(d["type"])
        if d.get("finish_reason") is not None:
            d["finish_reason"] = FinishReason(d["finish_reason"])
        if d.get("kv") is not None:
            d["kv"] = KVSource(**d["kv"])
        return cls(**d)


@dataclass
class WorkerInfo:
    """GET /internal/info: what the router needs to pair and load-balance workers."""

    role: Role
    model: str  # served model name
    max_model_len: int
    engine_id: str  # "<pod or host>-<epoch>"
    kv_compat: str  # tandem.dev/kv-compat: only equal kv_compat values are paired
    kv_backend: str
    ready: bool
    running: int  # sequences in the running batch
    waiting: int  # sequences queued
    kv_usage: float  # used / total blocks, 0..1
    outstanding_prompt_tokens: int  # prompt tokens queued or being prefilled
    # tokenizer_digest of what GET /internal/tokenizer serves; "" until the worker has computed it
    tokenizer_sha256: str = ""
    # The KV cache's dtype ("float32", "bfloat16", ...; "" while loading): how closely two workers'
    # log probabilities can agree (the router's handoff parity probe, router/parity/decisions.py).
    dtype: str = ""
    # The worker's KV transfer health, as at /internal/kv/health; None from a runtime without one
    # (vLLM). Its routers report it (ParityReport.kv_health), so the operator asks one router per
    # service instead of every worker.
    kv_health: KVHealth | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerInfo:
        d = dict(d)
        d["role"] = Role(d["role"])
        health = d.get("kv_health")
        d["kv_health"] = KVHealth.from_dict(health) if isinstance(health, dict) else None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def openai_error(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """The body of an OpenAI-format error response."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
