"""Which workers serve a request: pure functions over a snapshot of the pools.

- Pairing: prefill and decode workers are paired only within one `tandem.dev/generation`; when
  several generations are live (a rollout), the one whose newest worker appeared most recently
  and that has both a ready prefill and a ready decode worker wins, so new prefill never talks
  to old decode.
- Prefill: least outstanding prompt tokens (the worker's own count plus what this router sent
  it since the last poll). Decode: least running + waiting sequences, then KV usage.
- Conditional disaggregation: a prompt estimated below `short_prompt_threshold` tokens goes
  straight to a decode worker, which prefills it itself; so does every prompt when no prefill
  worker is usable. The router has no tokenizer, so the estimate is characters / 4 (about what
  BPE tokenizers average on English); it only steers, the worker counts exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.contracts.names import Role

CHARS_PER_TOKEN = 4


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


@dataclass
class Plan:
    """The route for one request: prefill on `prefill` (or none: decode-side prefill) then `decode`."""

    decode: WorkerView
    prefill: WorkerView | None = None
    reason: str = ""
    extra: dict = field(default_factory=dict)


def estimate_tokens(chars: int) -> int:
    return math.ceil(chars / CHARS_PER_TOKEN)


def prefill_load(w: WorkerView) -> tuple[int, int]:
    return (w.outstanding_prompt_tokens + w.router_prompt_tokens, w.running + w.waiting)


def decode_load(w: WorkerView) -> tuple[int, float]:
    return (max(w.running + w.waiting, w.router_inflight), w.kv_usage)


def pick_generation(prefill: Iterable[WorkerView], decode: Iterable[WorkerView]) -> str | None:
    """The generation to pair in: present in both ready pools, newest first; None if there is none."""
    newest: dict[str, float] = {}
    p_gens = {w.generation for w in prefill if w.ready}
    d_gens = {w.generation for w in decode if w.ready}
    for w in [*prefill, *decode]:
        if w.ready and w.generation in p_gens & d_gens:
            newest[w.generation] = max(newest.get(w.generation, -math.inf), w.first_seen)
    if not newest:
        return None
    return max(newest, key=lambda g: (newest[g], g))


def choose(
    workers: Iterable[WorkerView],
    prompt_chars: int,
    short_prompt_threshold: int,
    exclude: frozenset[str] = frozenset(),
    allow_prefill: bool = True,
) -> Plan | None:
    """Pick the workers for one request, or None when no decode-capable worker is ready."""
    usable = [w for w in workers if w.ready and w.url not in exclude]
    prefill = [w for w in usable if w.role is Role.PREFILL]
    # a decode worker prefills itself when needed; colocated workers do both
    decode = [w for w in usable if w.role in (Role.DECODE, Role.COLOCATED)]
    if not decode:
        return None
    if not allow_prefill or not prefill:
        reason = "no prefill worker" if allow_prefill else "prefill disabled"
        return Plan(decode=min(decode, key=decode_load), reason=reason)
    if estimate_tokens(prompt_chars) < short_prompt_threshold:
        return Plan(decode=min(decode, key=decode_load), reason="short prompt")
    gen = pick_generation(prefill, decode)
    if gen is None:
        return Plan(decode=min(decode, key=decode_load), reason="no matching generation")
    p = min((w for w in prefill if w.generation == gen), key=prefill_load)
    # prefer a pure decode worker for the handoff: colocated ones are the fallback pool
    d_pool = [w for w in decode if w.generation == gen]
    pure = [w for w in d_pool if w.role is Role.DECODE]
    d = min(pure or d_pool, key=decode_load)
    return Plan(decode=d, prefill=p, reason="disaggregated")


def choose_decode(
    workers: Iterable[WorkerView], exclude: frozenset[str] = frozenset()
) -> WorkerView | None:
    """A decode-capable worker for a resume or a fallback."""
    decode = [
        w for w in workers
        if w.ready and w.url not in exclude and w.role in (Role.DECODE, Role.COLOCATED)
    ]
    return min(decode, key=decode_load) if decode else None


def choose_prefill(
    workers: Iterable[WorkerView], generation: str, exclude: frozenset[str] = frozenset()
) -> WorkerView | None:
    """Another prefill worker of the same generation, for a retry."""
    pool = [
        w for w in workers
        if w.ready and w.url not in exclude and w.role is Role.PREFILL and w.generation == generation
    ]
    return min(pool, key=prefill_load) if pool else None
