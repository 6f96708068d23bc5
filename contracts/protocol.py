"""The internal HTTP protocol between the router and the workers, and between workers.

One source of truth for what crosses a process boundary on the data plane.
It never imports torch: the router uses it too.

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
  GET  /internal/kv/health      KV transfer health, read by the operator for KVTransferReady
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
import hashlib
from dataclasses import dataclass, field
from typing import Any

from tandem.contracts.names import Role

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


# A temperature below this is greedy: dividing logits by it only overflows the softmax (vLLM's
# epsilon). The worker's parsing and the engine both apply it.
GREEDY_TEMPERATURE_BELOW = 1e-5
# What a worker accepts in SamplingParams.stop (the router's own limits are lower by default):
# the stop check's automaton grows with the total, its time per token does not.
WORKER_MAX_STOP_STRINGS = 32
WORKER_MAX_STOP_CHARS = 1024  # each


def top_k_valid(k: int) -> bool:
    """The one top_k rule of the router and the workers: -1 or 0 is off (as vLLM takes both),
    any positive k keeps the k likeliest tokens."""
    return k >= -1


MAX_CACHE_SALT_CHARS = 256  # GenerateRequest.cache_salt

# The most alternatives a request may ask logprobs for (OpenAI's top_logprobs allows 20).
MAX_TOP_LOGPROBS = 20
# logit_bias values, as OpenAI bounds them.
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass
class SamplingParams:
    """What one sequence samples with. Fields past `ignore_eos` travel only when set (to_wire), so a
    router that does not use them still talks to a worker that does not know them."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off (top_k_valid)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens below min_p x the likeliest one's probability
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    presence_penalty: float = 0.0  # OpenAI's, over the generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's (CTRL's), over prompt and generated tokens
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id (as a string) -> bias
    # None: no logprobs; k >= 0: the chosen token's log probability and the k likeliest alternatives
    logprobs: int | None = None
    # The output's grammar (worker/engine/grammar.py): {"json_schema": {...}}, {"json_object": true},
    # {"regex": "..."}, {"choice": [...]} or {"lark": "..."}; None: unconstrained.
    structured: dict[str, Any] | None = None
    # Teacher forcing (internal: the router's handoff parity probe, router/parity_probe.py): the
    # token at output index i is forced_token_ids[i] whatever the draw, and logprobs score it, so two
    # paths through the model can be compared on the same continuation. Never set from the public API.
    forced_token_ids: list[int] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if k in _ALWAYS_SENT or v != _SAMPLING_DEFAULTS[k]}


_ALWAYS_SENT = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                          "ignore_eos"})
_SAMPLING_DEFAULTS = dataclasses.asdict(SamplingParams())


LOGPROB_FLOOR = -9999.0  # what a -inf log probability is reported as (JSON has no infinity; vLLM's value)


@dataclass
class TokenLogprobs:
    """One generated token's log probability and its `top` alternatives as (id, logprob), likeliest
    first. On the wire (to_wire) each id comes with its text, as the worker's tokenizer decodes it."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_wire(self, text: Any) -> dict[str, Any]:
        def one(tok: int, lp: float) -> dict[str, Any]:
            return {"id": tok, "token": text(tok), "logprob": max(lp, LOGPROB_FLOOR)}

        return one(self.token_id, self.logprob) | {"top": [one(t, lp) for t, lp in self.top]}


@dataclass
class KVRank:
    """Where one more rank of a tensor-parallel prefill (or migrating decode) worker serves its
    share of the KV heads: its own KV endpoint, read directly by the decode ranks that need it."""

    url: str  # base URL of the rank's HTTP API (/internal/kv/metadata)
    engine_id: str  # the rank's KV agent ("<engine_id of rank 0>-r<rank>")
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific (e.g. tcp host/port)


@dataclass
class KVSource:
    """Where a decode worker finds the KV a prefill worker computed (returned by /internal/prefill)."""

    url: str  # base URL of the prefill worker's HTTP API (its rank 0)
    engine_id: str  # "<pod or host>-<epoch>": a restarted worker gets a new one
    backend: str  # "nixl" | "tcp" | "memory"
    block_ids: list[int]  # the prefill worker's blocks, in sequence order
    num_tokens: int  # tokens whose KV the blocks hold (the prompt)
    # Unguessable, one per lease: a KV read, a release or an abort of the lease must quote it.
    # Empty matches nothing. Pass it only to the decode worker chosen for this request.
    lease_token: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific (e.g. tcp host/port)
    # A tensor-parallel source: ranks 1.. (rank 0 is url/engine_id/extra above), each holding the
    # KV heads tandem.contracts.kv_layout.kv_heads_of_rank gives it; one lease (rank 0's, above)
    # covers every rank's blocks. Empty: one rank.
    ranks: list[KVRank] = field(default_factory=list)
    # The tandem.dev/generation of the worker that leased the KV (a prefill worker, or a draining
    # decode worker). A worker of another generation refuses it (400 kv_generation_mismatch): the
    # same tokens through other weights are other KV, and must never reach its cache.
    generation: str = ""

    def __post_init__(self) -> None:
        self.ranks = [r if isinstance(r, KVRank) else KVRank(**r) for r in self.ranks]

    @property
    def tensor_parallel(self) -> int:
        return 1 + len(self.ranks)

    def rank(self, i: int) -> KVRank:
        """Rank i's endpoint (rank 0 is the source's own)."""
        return KVRank(self.url, self.engine_id, self.extra) if i == 0 else self.ranks[i - 1]


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"sampling": self.sampling.to_wire()}

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
    generation: str  # tandem.dev/generation: only equal generations are paired
    kv_backend: str
    ready: bool
    running: int  # sequences in the running batch
    waiting: int  # sequences queued
    kv_usage: float  # used / total blocks, 0..1
    outstanding_prompt_tokens: int  # prompt tokens queued or being prefilled
    # tokenizer_digest of what GET /internal/tokenizer serves; "" until the worker has computed it
    tokenizer_sha256: str = ""
    # The KV cache's dtype ("float32", "bfloat16", ...; "" while loading): how closely two workers'
    # log probabilities can agree (the router's handoff parity probe, router/parity.py).
    dtype: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerInfo:
        d = dict(d)
        d["role"] = Role(d["role"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# The files a router needs to tokenize as a worker does (tandem.router.tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_digest(files: dict[str, str]) -> str:
    """SHA-256 over the files' names and texts: equal digests mean the same tokenizer and template."""
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name].encode()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@dataclass
class TokenizerFiles:
    """GET /internal/tokenizer: names in TOKENIZER_FILES -> their text, and their tokenizer_digest."""

    sha256: str
    files: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenizerFiles:
        files = d.get("files")
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in files.items()):
            raise ValueError("tokenizer files must be an object of file name -> text")
        sha = d.get("sha256")
        if sha != tokenizer_digest(files):
            raise ValueError("tokenizer files do not match their sha256")
        return cls(sha, dict(files))


class KVEventType(enum.StrEnum):
    SNAPSHOT = "snapshot"  # first line of every stream: all the block hashes held, as of `seq`
    UPDATE = "update"  # hashes stored and removed since the previous line; seq is the previous + 1
    HEARTBEAT = "heartbeat"  # nothing changed; `seq` repeats the last one


@dataclass
class KVEventMessage:
    """One NDJSON line of GET /internal/kv/events. Hashes (tandem.contracts.prefix.block_hashes over
    `block_size` tokens with `salt`) travel as hex. `enabled` is false on a worker whose engine keeps
    no prefix cache: its snapshot is empty and no update follows."""

    type: KVEventType
    seq: int
    engine_id: str = ""  # on SNAPSHOT: a restarted worker has a new one
    block_size: int = 0  # on SNAPSHOT
    salt: str = ""  # on SNAPSHOT, hex
    enabled: bool = True  # on SNAPSHOT
    hashes: list[str] = field(default_factory=list)  # on SNAPSHOT
    stored: list[str] = field(default_factory=list)  # on UPDATE
    removed: list[str] = field(default_factory=list)  # on UPDATE

    def to_dict(self) -> dict[str, Any]:
        keep = {KVEventType.SNAPSHOT: ("engine_id", "block_size", "salt", "enabled", "hashes"),
                KVEventType.UPDATE: ("stored", "removed"), KVEventType.HEARTBEAT: ()}[self.type]
        return {"type": self.type.value, "seq": self.seq} | {k: getattr(self, k) for k in keep}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEventMessage:
        d = dict(d)
        d["type"] = KVEventType(d["type"])
        known = {f.name for f in dataclasses.fields(cls)}
        msg = cls(**{k: v for k, v in d.items() if k in known})
        if not isinstance(msg.seq, int) or isinstance(msg.seq, bool):
            raise ValueError(f"kv event seq must be an integer, got {msg.seq!r}")
        return msg


def openai_error(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """The body of an OpenAI-format error response."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
