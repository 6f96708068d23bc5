"""What one sequence samples with, as it crosses from the router to a worker: SamplingParams, the
bounds both sides check it against, and a token's log probabilities on the wire (TokenLogprobs).
Shared by the router's parsing and the worker's, so the two never disagree on a limit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

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
    # Teacher forcing (internal: the router's handoff parity probe, router/parity/probe.py): the
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
