"""The routing policy interface: what a policy sees (one request's info, a `Snapshot`) and what it
decides (a route, a prefill retry target, a decode resume target).

A policy only decides, from its inputs alone: the same request and snapshot give the same choice
(tests/router/test_decide_gives_the_same_action_twice.py). The request state machine (decide.py)
asks it for workers and the driver (orchestrator.py) makes every call, retry and abort, so a new
policy plugs in without touching either. Whatever a policy would read that changes (the workers'
load, the prefix-cache blocks each holds, the round-robin cursor) comes in the snapshot the
driver takes (`WorkerSet.snapshot`): a policy that routes by prefix sets `uses_prefix_index`,
and the router then keeps a `PrefixIndex` (fed by the workers' KV events) whose answer for this
request is the snapshot's `cached`.

`PairedPolicy` holds the rules every policy here keeps and leaves the choice within a pool to
its subclasses:
- Pairing: prefill and decode workers are paired only within one `tandem.dev/kv-compat`; when
  several are live (a rollout), the one whose newest worker appeared most recently and that has
  both a ready prefill and a ready decode worker wins, so new prefill never talks to old decode.
- Conditional disaggregation: a prompt below `short_prompt_threshold` tokens goes straight to a
  decode worker, which prefills it itself; so does every prompt when no prefill worker is usable.
  Token counts are exact when the router tokenized the prompt (or the client sent ids), else
  characters / 4 (about what BPE tokenizers average on English).
- Proven pairings only: a worker takes part in a KV handoff only once the router's parity probe
  verified it (router/parity/decisions.py; `handoff_allowed`); a kv_compat with no proven pair is served by
  decode-side prefill (route `parity_unverified`, or `parity_mismatch` when a probe disagreed).
- Load-aware disaggregation (`prefill_saturated`): when every ready prefill worker of the paired
  kv_compat already has at least `prefill_saturated_tokens` prompt tokens queued, a
  decode-capable worker with headroom prefills the prompt itself, in the small chunks its engine
  allows a decode worker. Headroom: fewer than `decode_headroom_sequences` sequences running or
  waiting, KV usage under DECODE_HEADROOM_KV, and fewer prompt tokens queued than the least
  busy prefill worker (so the prompt starts sooner there). Without such a worker the prompt
  waits for prefill, and decode streams keep their steady gaps.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from tandem.contracts import gateway
from tandem.contracts.handoff_parity import ParityState
from tandem.contracts.names import Role
from tandem.contracts.prefix import block_hashes, request_salt
from tandem.contracts.routing import (
    DECODE_HEADROOM_SEQUENCES,
    PREFILL_SATURATED_TOKENS,
    PREFIX_SEQUENCE_COST_TOKENS,
    RouteReason,
)

CHARS_PER_TOKEN = 4
DECODE_HEADROOM_KV = 0.9  # a decode worker whose KV cache is fuller than this does not prefill for others


def estimate_tokens(chars: int) -> int:
    return math.ceil(chars / CHARS_PER_TOKEN)


@dataclass
class WorkerView:
    """What the policy knows about one worker at one instant."""

    url: str
    role: Role
    kv_compat: str = ""
    ready: bool = False
    first_seen: float = 0.0  # monotonic time the router first saw it (orders kv_compat values)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    outstanding_prompt_tokens: int = 0
    # what this router sent it and has not yet seen reflected in a poll
    router_inflight: int = 0
    router_planned: int = 0  # decode: sequences planned here, their prompts still in prefill
    router_prompt_tokens: int = 0
    tokenizer_sha256: str = ""  # what its /internal/info reports ("" unknown)
    dtype: str = ""  # its KV cache's dtype, from /internal/info
    engine_id: str = ""  # from /internal/info: a restarted worker (same address) has a new one
    # Its standing from the handoff parity probe (router/parity/decisions.py); None: the router does not probe.
    parity: ParityState | None = None

    @property
    def serves_decode(self) -> bool:
        """Decode workers prefill themselves when needed; colocated workers do both."""
        return self.role in (Role.DECODE, Role.COLOCATED)

    @property
    def handoff_allowed(self) -> bool:
        """May take part in a prefill-to-decode KV handoff: proven by the parity probe (or not probed)."""
        return self.parity is None or self.parity is ParityState.VERIFIED

    @property
    def parity_mismatch(self) -> bool:
        """A parity probe found it disagreeing: no KV is ever handed to it."""
        return self.parity is ParityState.MISMATCH


@dataclass(frozen=True)
class Pinned:
    """The workers a gateway's endpoint picker chose (contracts/gateway.py), which the decode pod's
    sidecar follows: decode on `decode` (a worker URL), prefill on the first usable worker of
    `prefill` (endpoints `host:port`; none: the decode worker prefills the prompt itself)."""

    decode: str
    prefill: tuple[str, ...] = ()


@dataclass(frozen=True)
class RequestInfo:
    """What a policy knows about one request."""

    request_id: str
    prompt_tokens: int  # exact when the token ids are known, else estimate_tokens(characters)
    prompt_token_ids: list[int] | None = None  # the router tokenized it, or the client sent ids
    cache_salt: str | None = None  # the tenant's salt: its blocks are named apart (contracts.prefix)
    pinned: Pinned | None = None  # behind a gateway: the workers its picker chose
    _hashes: dict[tuple[int, bytes], list[bytes]] = field(default_factory=dict, compare=False, repr=False)

    def block_hashes(self, block_size: int, salt: bytes = b"") -> list[bytes]:
        """The prompt's full blocks as tandem.contracts.prefix names them ([] without token ids);
        computed once per block size and salt."""
        if self.prompt_token_ids is None:
            return []
        key = (block_size, salt)
        if key not in self._hashes:
            self._hashes[key] = block_hashes(self.prompt_token_ids, block_size, request_salt(salt, self.cache_salt))
        return self._hashes[key]


@dataclass(frozen=True)
class Route:
    """The route for one request: prefill on `prefill` (None: decode-side prefill), then `decode`."""

    decode: WorkerView
    prefill: WorkerView | None
    reason: RouteReason
    # prompt tokens the chosen workers already hold in their prefix caches (prefix-aware policies)
    cached_prefill_tokens: int = 0
    cached_decode_tokens: int = 0


@dataclass(frozen=True)
class PolicySettings:
    """What the router's configuration tells every policy."""

    short_prompt_threshold: int = 0  # prompt tokens; 0 sends every prompt through prefill
    prefill_saturated_tokens: int = PREFILL_SATURATED_TOKENS  # queued prompt tokens: saturated; 0: never
    decode_headroom_sequences: int = DECODE_HEADROOM_SEQUENCES  # fewer: a decode worker may prefill then
    prefix_sequence_cost_tokens: int = PREFIX_SEQUENCE_COST_TOKENS  # a running sequence, in prompt tokens


@dataclass(frozen=True)
class Snapshot:
    """Everything a policy may read about the workers, as it was at one instant, for one request: the
    workers as polled (with this router's counts), the leading prompt tokens each holds in its prefix
    cache (prefix index), and the round-robin cursor per pool (choices made so far). Nothing in it is
    live, so deciding twice over it gives the same answer."""

    workers: tuple[WorkerView, ...] = ()
    cached: Mapping[str, int] = field(default_factory=dict)  # url -> prompt tokens it holds (absent: 0)
    turns: Mapping[Role, int] = field(default_factory=dict)  # Role.PREFILL / Role.DECODE -> cursor

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(self.workers))

    def cached_tokens(self, w: WorkerView) -> int:
        return self.cached.get(w.url, 0)

    def turn(self, pool: Role) -> int:
        return self.turns.get(pool, 0)

    def among(self, workers: Iterable[WorkerView]) -> Snapshot:
        """The same instant with fewer workers to choose from."""
        return dataclasses.replace(self, workers=tuple(workers))


class RoutingPolicy(abc.ABC):
    """Chooses workers; pure decisions over a snapshot, called once per step of a request. A policy
    keeps no state of its own between calls: what must change from one choice to the next (the
    round-robin cursor) is the snapshot's."""

    uses_prefix_index: ClassVar[bool] = False  # the router keeps a PrefixIndex for the snapshots' `cached`

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings or PolicySettings()

    @abc.abstractmethod
    def route(self, request: RequestInfo, snap: Snapshot) -> Route | None:
        """The route for a new request; None when no decode-capable worker is ready."""

    @abc.abstractmethod
    def retry_prefill(
        self, request: RequestInfo, route: Route, snap: Snapshot, exclude: frozenset[str]
    ) -> WorkerView | None:
        """Another prefill worker for `route` after a failure; None: fall back to decode-side prefill."""

    @abc.abstractmethod
    def resume_decode(
        self, request: RequestInfo, snap: Snapshot, exclude: frozenset[str]
    ) -> WorkerView | None:
        """A decode-capable worker to continue a request whose decode worker failed; None: give up."""


def queued_prompt_tokens(w: WorkerView) -> int:
    """Prompt tokens waiting for compute there: as the worker reported, plus what this router sent since."""
    return w.outstanding_prompt_tokens + w.router_prompt_tokens


def decode_seqs(w: WorkerView) -> int:
    return max(w.running + w.waiting, w.router_inflight) + w.router_planned


def prefill_load(w: WorkerView) -> tuple[int, int]:
    return (queued_prompt_tokens(w), w.running + w.waiting)


def decode_load(w: WorkerView) -> tuple[int, float]:
    return (decode_seqs(w), w.kv_usage)


def pick_kv_compat(prefill: Iterable[WorkerView], decode: Iterable[WorkerView]) -> str | None:
    """The kv_compat to pair in: present in both ready pools, newest first; None if there is none."""
    prefill, decode = list(prefill), list(decode)
    p_compat = {w.kv_compat for w in prefill if w.ready}
    d_compat = {w.kv_compat for w in decode if w.ready}
    newest: dict[str, float] = {}
    for w in [*prefill, *decode]:
        if w.ready and w.kv_compat in p_compat & d_compat:
            newest[w.kv_compat] = max(newest.get(w.kv_compat, -math.inf), w.first_seen)
    if not newest:
        return None
    return max(newest, key=lambda g: (newest[g], g))


def pinned_route(request: RequestInfo, snap: Snapshot) -> Route | None:
    """The route a gateway's picker chose for `request`, checked against what this router knows: decode
    on the pinned worker, prefill on the first named worker that may hand it KV (a ready prefill
    worker of its kv_compat, both proven by the parity probe where it runs), else on the decode
    worker itself. None when nothing is pinned or the pinned decode worker is not ready here (the
    policy then routes as without a gateway)."""
    pin = request.pinned
    if pin is None:
        return None
    decode = next((w for w in snap.workers if w.url == pin.decode and w.ready and w.serves_decode), None)
    if decode is None:
        return None
    if not pin.prefill:
        return Route(decode, None, RouteReason.GATEWAY_DECODE)
    by_endpoint = {gateway.endpoint_of(w.url): w for w in snap.workers}
    for endpoint in pin.prefill:
        w = by_endpoint.get(endpoint)
        if (w is not None and w.ready and w.role is Role.PREFILL and w.kv_compat == decode.kv_compat
                and w.handoff_allowed and decode.handoff_allowed):
            return Route(decode, w, RouteReason.DISAGGREGATED)
    return Route(decode, None, RouteReason.GATEWAY_PREFILL_UNUSABLE)


class PairedPolicy(RoutingPolicy):
    """Generation pairing and conditional disaggregation; subclasses pick one worker from a pool."""

    @abc.abstractmethod
    def pick_prefill(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        """One of `candidates` (never empty): ready prefill workers of one kv_compat."""

    @abc.abstractmethod
    def pick_decode(self, request: RequestInfo, candidates: list[WorkerView], snap: Snapshot) -> WorkerView:
        """One of `candidates` (never empty): ready decode-capable workers."""

    def route(self, request: RequestInfo, snap: Snapshot) -> Route | None:
        pinned = pinned_route(request, snap)
        if pinned is not None:
            return pinned
        usable = [w for w in snap.workers if w.ready]
        prefill = [w for w in usable if w.role is Role.PREFILL]
        decode = [w for w in usable if w.serves_decode]
        if not decode:
            return None
        if not prefill:
            return Route(self.pick_decode(request, decode, snap), None, RouteReason.NO_PREFILL_WORKER)
        if request.prompt_tokens < self.settings.short_prompt_threshold:
            return Route(self.pick_decode(request, decode, snap), None, RouteReason.SHORT_PROMPT)
        gen = pick_kv_compat(prefill, decode)
        if gen is None:
            return Route(self.pick_decode(request, decode, snap), None, RouteReason.NO_MATCHING_KV_COMPAT)
        proven = pick_kv_compat([w for w in prefill if w.handoff_allowed], [w for w in decode if w.handoff_allowed])
        if proven is None:  # no pairing the parity probe has proven (yet): as without a prefill pool
            failed = any(w.parity_mismatch for w in [*prefill, *decode] if w.kv_compat == gen)
            reason = RouteReason.PARITY_MISMATCH if failed else RouteReason.PARITY_UNVERIFIED
            return Route(self.pick_decode(request, decode, snap), None, reason)
        gen = proven
        prefill = [w for w in prefill if w.handoff_allowed]
        pool = [w for w in prefill if w.kv_compat == gen]
        helper = self.saturated_helper(request, pool, decode, snap)
        if helper is not None:
            return Route(helper, None, RouteReason.PREFILL_SATURATED)
        p = self.pick_prefill(request, pool, snap)
        # prefer a pure decode worker for the handoff: colocated ones are the fallback pool
        paired = [w for w in decode if w.kv_compat == gen and w.handoff_allowed]
        pure = [w for w in paired if w.role is Role.DECODE]
        return Route(self.pick_decode(request, pure or paired, snap), p, RouteReason.DISAGGREGATED)

    def saturated_helper(
        self, request: RequestInfo, prefill: list[WorkerView], decode: list[WorkerView], snap: Snapshot
    ) -> WorkerView | None:
        """Load-aware disaggregation: the decode-capable worker that prefills the prompt itself when
        the `prefill` pool is saturated; None: the prompt waits for prefill."""
        limit = self.settings.prefill_saturated_tokens
        queued = min(queued_prompt_tokens(w) for w in prefill)
        if limit <= 0 or queued < limit:
            return None
        room = [w for w in decode if decode_seqs(w) < self.settings.decode_headroom_sequences
                and w.kv_usage < DECODE_HEADROOM_KV and queued_prompt_tokens(w) < queued]
        return self.pick_decode(request, room, snap) if room else None

    def retry_prefill(
        self, request: RequestInfo, route: Route, snap: Snapshot, exclude: frozenset[str]
    ) -> WorkerView | None:
        pool = [
            w for w in snap.workers
            if w.ready and w.url not in exclude and w.role is Role.PREFILL
            and w.kv_compat == route.decode.kv_compat and w.handoff_allowed
        ]
        if request.pinned is not None and route.reason is RouteReason.DISAGGREGATED:  # the picker's others
            pool = [w for w in pool if gateway.endpoint_of(w.url) in request.pinned.prefill]
        return self.pick_prefill(request, pool, snap) if pool else None

    def resume_decode(
        self, request: RequestInfo, snap: Snapshot, exclude: frozenset[str]
    ) -> WorkerView | None:
        pool = [w for w in snap.workers if w.ready and w.url not in exclude and w.serves_decode]
        return self.pick_decode(request, pool, snap) if pool else None
