"""One client request's journey across workers, as data: the only place its state lives.

A `Journey` holds everything the router knows about one sequence the client asked for: where it is
(`Phase`), the route it took, every worker it touched and the lease tokens it holds there, what
the client has received (tokens, characters: counted here only, each `Tokens` event carries its
offset), what it counts on each worker meanwhile (`Charge`s, which the worker set adds to its
views), and what the next decode worker needs (the KV to pull and whose lease it is, the workers
excluded, failures and busy answers so far, a migration in progress). The pure `decide`
(decide.py) moves it from one state to the next; the driver (orchestrator.py) performs the calls
that `decide` asks for and never keeps request state of its own. A `ClientRequest` is the parent
record of one client request: its choices' journeys (one, or `n`).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

from tandem.contracts import timing
from tandem.contracts.kv_source import KVSource
from tandem.contracts.protocol import FinishReason, GenerateRequest
from tandem.contracts.routing import RouteReason
from tandem.router.policies.base import (
    RequestInfo,
    Route,
    RoutingPolicy,
    WorkerView,
    estimate_tokens,
)
from tandem.router.validation import Limits, ParsedRequest


@dataclass
class Started:
    """The client's stream may start: a worker accepted the request and counted its prompt."""

    prompt_tokens: int


@dataclass
class Tokens:
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None = None  # per token (TokenLogprobs.to_wire), when the request asked
    offset: int = 0  # characters of generated text the client had before `text` (completions' text_offset)


@dataclass
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


Event = Started | Tokens | Finished


class Phase(enum.StrEnum):
    """Where a request is; logged when it ends, so an early end says where it happened."""

    ROUTE = "route"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"  # the client got a finish: nothing to abort
    FAILED = "failed"  # ended with an error the client sees


@dataclass(frozen=True)
class Rules:
    """What the router's configuration says about every journey."""

    policy: RoutingPolicy
    limits: Limits = field(default_factory=Limits)
    max_prefill_attempts: int = 2
    max_resumes: int = 2
    busy_wait_s: float = timing.BUSY_WAIT_S  # waiting for a busy decode worker once the client has tokens
    # --first-token with-decode: a prefill's first token waits for the decode worker's first output,
    # so the handoff is in the time to first token rather than a gap in the stream (decide.py)
    hold_first_token: bool = False


@dataclass(frozen=True)
class Charge:
    """What one journey counts on one worker until that worker's own numbers (its next poll) catch up:
    an open call there, a sequence planned there while its prompt is prefilled elsewhere, prompt
    tokens queued there until their first token. Kept by `decide`, summed by the worker set."""

    inflight: int = 0
    prompt_tokens: int = 0
    planned: int = 0


@dataclass
class Move:
    """A migration under way: from which worker, since when (until the next worker's first token)."""

    source: str
    since: float


def request_info(req: ParsedRequest, request_id: str) -> RequestInfo:
    """What the policy sees of a request: its size (exact for token ids, else estimated)."""
    if req.prompt_token_ids is not None:
        return RequestInfo(request_id, len(req.prompt_token_ids), list(req.prompt_token_ids),
                           cache_salt=req.cache_salt, pinned=req.pinned)
    return RequestInfo(request_id, estimate_tokens(req.prompt_chars()), cache_salt=req.cache_salt, pinned=req.pinned)


@dataclass
class Journey:
    """One client request from arrival to its end (see the module docstring)."""

    request_id: str
    phase: Phase = Phase.ROUTE
    route_reason: RouteReason | None = None
    touched: list[str] = field(default_factory=list)  # every worker it reached: aborted if it ends early
    prefill_url: str | None = None
    decode_url: str | None = None
    lease_tokens: dict[str, str] = field(default_factory=dict)  # worker url -> the KV lease's token there
    # set on arrival
    request: ParsedRequest | None = None
    rules: Rules | None = None
    info: RequestInfo | None = None
    route: Route | None = None
    # what the client has, across prefill, decode, resumes and migrations
    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    generated: list[int] = field(default_factory=list)
    chars: int = 0  # characters of generated text the client has
    finish_reason: str = FinishReason.STOP.value
    # prefill
    prefill_attempts: int = 0
    prefill_tried: set[str] = field(default_factory=set)
    # decode
    target: WorkerView | None = None  # the decode worker asked last
    kv: KVSource | None = None  # what the next decode worker pulls
    lease_holder: str | None = None  # the worker whose lease `kv` is
    kv_compat: str | None = None  # the kv_compat of the model that computed `kv`
    excluded: set[str] = field(default_factory=set)  # dead or leaving: never asked again
    failures: int = 0  # decode failures (a resume each)
    failure: Exception | None = None  # the failure being handled (its copy is being aborted)
    # a decode worker continued from KV that was not this prompt's (HandoffDiverged): that worker's
    # prefix cache may hold it under this prompt's blocks, so every later worker computes apart
    cache_apart: bool = False
    busy: dict[str, float] = field(default_factory=dict)  # busy decode workers -> their Retry-After
    busy_deadline: float | None = None  # monotonic end of the waiting allowed to this request
    move: Move | None = None
    charges: dict[str, Charge] = field(default_factory=dict)  # worker url -> what it counts there now
    held: tuple[Event, ...] = ()  # a prefill's first token, until the decode worker's first output (Rules)

    @property
    def done(self) -> bool:
        return self.phase is Phase.FINISHED

    def touch(self, url: str) -> None:
        if url not in self.touched:
            self.touched.append(url)

    def tokens(self, token_ids: list[int], text: str, logprobs: list[dict] | None = None) -> Tokens:
        """The client's next tokens: they join what it has, ids and characters (counted here only: a
        resume's emitted_chars, each event's offset)."""
        ev = Tokens(token_ids, text, logprobs, offset=self.chars)
        self.generated.extend(token_ids)
        self.chars += len(text)
        return ev

    def clear_kv(self) -> None:
        self.kv = self.lease_holder = self.kv_compat = None

    def cache_salt(self) -> str | None:
        """The client's prefix-cache salt; after a diverged handoff, one of this request's own (cached
        blocks under the prompt's names may be the wrong KV: none is reused)."""
        assert self.request is not None
        salt = self.request.cache_salt
        if not self.cache_apart:
            return salt
        return "recompute-" + hashlib.sha256(f"{salt or ''}\0{self.request_id}".encode()).hexdigest()

    def worker_request(self, decode: bool) -> GenerateRequest:
        """The worker request: the client's prompt, or its token ids once a worker tokenized it, plus
        (for decode) the tokens so far, the text the client has, and where their KV is."""
        req = self.request
        assert req is not None
        greq = GenerateRequest(
            request_id=self.request_id, prompt=req.prompt, messages=req.messages,
            prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
            chat_options=req.chat_options if req.messages is not None else None, cache_salt=self.cache_salt(),
            fairness_id=req.flow[0], priority=req.flow[1],
        )
        if decode:
            if self.prompt_ids is not None:
                greq.prompt, greq.messages, greq.prompt_token_ids = None, None, self.prompt_ids
            greq.generated_token_ids, greq.emitted_chars, greq.kv_source = list(self.generated), self.chars, self.kv
            greq.migrated_from = self.lease_holder if self.move is not None and self.kv is not None else None
        return greq


@dataclass
class ClientRequest:
    """One client request, the parent of its choices' journeys: choice 0 keeps the request's id, choice
    i of `n` > 1 is `<id>-<i>` (each a request of its own to the workers, fan_out.py). What the
    `request done` log line reports."""

    request_id: str
    choices: list[Journey] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices.append(Journey(self.request_id))

    def fan_out(self, n: int) -> list[Journey]:
        """The journeys of `n` choices (the first is the one already there)."""
        self.choices[1:] = [Journey(f"{self.request_id}-{i}") for i in range(1, n)]
        return self.choices

    def summary(self) -> dict[str, object]:
        """Where the request went (the `request done` line): choice 0's route, phase and workers; with
        n > 1, each choice's too."""
        out: dict[str, object] = _where(self.choices[0])
        if len(self.choices) > 1:
            out["choices"] = [_where(j) for j in self.choices]
        return out


def _where(j: Journey) -> dict[str, object]:
    return {"route": j.route_reason and str(j.route_reason), "phase": str(j.phase), "prefill": j.prefill_url,
            "decode": j.decode_url}
