"""The engine's counters, read by the worker's Prometheus collector at scrape time."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    steps_total: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    # Tokens run through the model other than one per decode step: prompts prefilled here, and
    # sequences recomputed (after a preemption, or resumed without their KV).
    prefill_tokens_computed_total: int = 0
    # Sequences handed out by a draining engine: "kv" with their KV leased, "recompute" without.
    migrated_out: dict[str, int] = field(default_factory=dict)
