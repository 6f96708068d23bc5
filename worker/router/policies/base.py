"""The routing policy interface: what a policy sees (one request's info, a snapshot of the workers)
and what it decides (a plan, a prefill retry target, a decode resume target).

A policy only decides. The request state machine (orchestrator.py) makes every call, retry and
abort, so a new policy plugs in without touching it:
- a prefix-aware policy reads `RequestInfo.prompt_token_ids` / `block_hashes` (filled when the
  router knows the prompt's tokens) and an index of which worker holds which blocks, handed to
  it at construction with `PolicySettings`, in `pick_prefill` / `pick_decode`;
- load-aware disaggregation overrides `plan` to return `Plan(decode=d, prefill=None,
  reason=RouteReason.PREFILL_SATURATED)` when the prefill pool is saturated and `d` has
  headroom: a plan without a prefill worker already means decode-side prefill.

`PairedPolicy` holds the rules every policy here keeps and leaves the choice within a pool to
its subclasses:
- Pairing: prefill and decode workers are paired only within one `tandem.dev/generation`; when
  several are live (a rollout), the one whose newest worker appeared most recently and that has
  both a ready prefill and a ready decode worker wins, so new prefill never talks to old decode.
- Conditional disaggregation: a prompt below `short_prompt_threshold` tokens goes straight to a
  decode worker, which prefills it itself; so does every prompt when no prefill worker is usable.
  The router has no tokenizer, so unless the client sent token ids the size is characters / 4
  (about what BPE tokenizers average on English); it only steers, the worker counts exactly.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem.contracts.names import Role
from tandem.contracts.routing import RouteReason

CHARS_PER_TOKEN = 4


def estimate_tokens(chars: int) -> int:
    return math.ceil(chars / CHARS_PER_TOKEN)


@dataclass
class WorkerView:
    """What the policy knows about one worker at one instant."""

    url: str
    role: Role
    generation: str = ""
    ready: bool = False
    first_seen: float = 0.0  # monotonic time the router first saw it (orders generations)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    outstanding_prompt_tokens: int = 0
    # what this router sent it and has not yet seen reflected in a poll
    router_inflight: int = 0
    router_prompt_tokens: int = 0

    @property
    def serves_decode(self) -> bool:
        """Decode workers prefill themselves when needed; colocated workers do both."""
        return self.role in (Role.DECODE, Role.COLOCATED)


@dataclass(frozen=True)
class RequestInfo:
    """What a policy knows about one request."""

    request_id: str
    prompt_tokens: int  # exact when the token ids are known, else estimate_tokens(characters)
    prompt_token_ids: list[int] | None = None  # known when the client sent ids (later: a router tokenizer)
    block_hashes: list[bytes] | None = None  # tandem.contracts.prefix names of its full blocks, when known


@dataclass(frozen=True)
class Plan:
    """The route for one request: prefill on `prefill` (None: decode-side prefill), then `decode`."""

    decode: WorkerView
    prefill: WorkerView | None
    reason: RouteReason


@dataclass(frozen=True)
class PolicySettings:
    """What the router's configuration tells every policy."""

    short_prompt_threshold: int = 0  # estimated tokens; 0 sends every prompt through prefill


class RoutingPolicy(abc.ABC):
    """Chooses workers; pure decisions over a snapshot, called once per step of a request."""

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings or PolicySettings()

    @abc.abstractmethod
    def plan(self, request: RequestInfo, workers: Sequence[WorkerView]) -> Plan | None:
        """The route for a new request; None when no decode-capable worker is ready."""

    @abc.abstractmethod
    def retry_prefill(
        self, request: RequestInfo, plan: Plan, workers: Sequence[WorkerView], exclude: frozenset[str]
    ) -> WorkerView | None:
        """Another prefill worker for `plan` after a failure; None: fall back to decode-side prefill."""

    @abc.abstractmethod
    def resume_decode(
        self, request: RequestInfo, workers: Sequence[WorkerView], exclude: frozenset[str]
    ) -> WorkerView | None:
        """A decode-capable worker to continue a request whose decode worker failed; None: give up."""


def prefill_load(w: WorkerView) -> tuple[int, int]:
    return (w.outstanding_prompt_tokens + w.router_prompt_tokens, w.running + w.waiting)


def decode_load(w: WorkerView) -> tuple[int, float]:
    return (max(w.running + w.waiting, w.router_inflight), w.kv_usage)


def pick_generation(prefill: Iterable[WorkerView], decode: Iterable[WorkerView]) -> str | None:
    """The generation to pair in: present in both ready pools, newest first; None if there is none."""
    prefill, decode = list(prefill), list(decode)
    p_gens = {w.generation for w in prefill if w.ready}
    d_gens = {w.generation for w in decode if w.ready}
    newest: dict[str, float] = {}
    for w in [*prefill, *decode]:
        if w.ready and w.generation in p_gens & d_gens:
            newest[w.generation] = max(newest.get(w.generation, -math.inf), w.first_seen)
    if not newest:
        return None
    return max(newest, key=lambda g: (newest[g], g))


class PairedPolicy(RoutingPolicy):
    """Generation pairing and conditional disaggregation; subclasses pick one worker from a pool."""

    @abc.abstractmethod
    def pick_prefill(self, request: RequestInfo, candidates: list[WorkerView]) -> WorkerView:
        """One of `candidates` (never empty): ready prefill workers of one generation."""

    @abc.abstractmethod
    def pick_decode(self, request: RequestInfo, candidates: list[WorkerView]) -> WorkerView:
        """One of `candidates` (never empty): ready decode-capable workers."""

    def plan(self, request: RequestInfo, workers: Sequence[WorkerView]) -> Plan | None:
        usable = [w for w in workers if w.ready]
        prefill = [w for w in usable if w.role is Role.PREFILL]
        decode = [w for w in usable if w.serves_decode]
        if not decode:
            return None
        if not prefill:
            return Plan(self.pick_decode(request, decode), None, RouteReason.NO_PREFILL_WORKER)
        if request.prompt_tokens < self.settings.short_prompt_threshold:
            return Plan(self.pick_decode(request, decode), None, RouteReason.SHORT_PROMPT)
        gen = pick_generation(prefill, decode)
        if gen is None:
            return Plan(self.pick_decode(request, decode), None, RouteReason.NO_MATCHING_GENERATION)
        p = self.pick_prefill(request, [w for w in prefill if w.generation == gen])
        # prefer a pure decode worker for the handoff: colocated ones are the fallback pool
        paired = [w for w in decode if w.generation == gen]
        pure = [w for w in paired if w.role is Role.DECODE]
        return Plan(self.pick_decode(request, pure or paired), p, RouteReason.DISAGGREGATED)

    def retry_prefill(
        self, request: RequestInfo, plan: Plan, workers: Sequence[WorkerView], exclude: frozenset[str]
    ) -> WorkerView | None:
        pool = [
            w for w in workers
            if w.ready and w.url not in exclude and w.role is Role.PREFILL
            and w.generation == plan.decode.generation
        ]
        return self.pick_prefill(request, pool) if pool else None

    def resume_decode(
        self, request: RequestInfo, workers: Sequence[WorkerView], exclude: frozenset[str]
    ) -> WorkerView | None:
        pool = [w for w in workers if w.ready and w.url not in exclude and w.serves_decode]
        return self.pick_decode(request, pool) if pool else None
