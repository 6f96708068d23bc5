"""Workloads: seeded arrival times, prompt and output lengths, and prompts of a target length.

Pure and deterministic for a given seed, so every arm sees the same sequence of requests.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

# Words the toy tokenizer was trained on, so prompts tokenize about as densely as real text does.
WORDS = (
    "the quick brown fox jumps over lazy dog while cat sleeps in sun prefill reads whole prompt "
    "at once decode writes one token time a paged key value cache keeps fixed size blocks pool "
    "allocated start up kubernetes schedules pods onto nodes and an operator reconciles what it "
    "observes upon there was little model that wanted to speak every language numbers like hello "
    "world how are you today i am fine thank router sends streams tokens from worker continuous "
    "batching lets sequences join leave running batch step beginning engine loads weights then "
    "serves requests until stopped she sells sea shells by shore surely answer question briefly"
).split()


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload: who arrives when, with what prompt and output length."""

    name: str
    mode: str  # "poisson" (open loop at `rate` requests/s) | "closed" (`concurrency` in flight)
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range of prompt tokens (uniform)
    output_len: int
    rate: float = 0.0
    concurrency: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("poisson", "closed"):
            raise ValueError(f"mode must be 'poisson' or 'closed', got {self.mode!r}")
        if self.mode == "poisson" and self.rate <= 0:
            raise ValueError("a poisson workload needs rate > 0")
        if self.mode == "closed" and self.concurrency < 1:
            raise ValueError("a closed-loop workload needs concurrency >= 1")
        if not 1 <= self.prompt_len[0] <= self.prompt_len[1]:
            raise ValueError(f"bad prompt_len range {self.prompt_len}")


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of n requests arriving as a Poisson process.

    The first request arrives after one exponential gap, like the others, so a run's offered
    load is `rate` from its first instant.
    """
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def prompt_lengths(lo: int, hi: int, n: int, seed: int) -> list[int]:
    rng = random.Random(f"lengths-{seed}")
    return [rng.randint(lo, hi) for _ in range(n)]


def make_prompt(count_tokens: Callable[[str], int], target: int, seed: int) -> str:
    """Random words whose token count (as `count_tokens` counts, BOS included) is the target or
    just under it; the server's usage.prompt_tokens is the final word on the actual length."""
    rng = random.Random(f"prompt-{seed}")
    words: list[str] = []
    # Grow in chunks, then back off word by word: few tokenizer calls for long prompts.
    while True:
        trial = words + [rng.choice(WORDS) for _ in range(16)]
        if count_tokens(" ".join(trial)) > target:
            break
        words = trial
    while True:
        trial = words + [rng.choice(WORDS)]
        if count_tokens(" ".join(trial)) > target:
            return " ".join(words)
        words = trial


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    prompt: str
    prompt_tokens_target: int
    max_tokens: int
    at_s: float  # send time for open loop; 0 for closed loop


def plan(spec: WorkloadSpec, count_tokens: Callable[[str], int]) -> list[PlannedRequest]:
    """The request list every arm replays for this workload."""
    lens = prompt_lengths(*spec.prompt_len, spec.num_requests, spec.seed)
    arrivals = (
        poisson_arrivals(spec.rate, spec.num_requests, spec.seed)
        if spec.mode == "poisson"
        else [0.0] * spec.num_requests
    )
    out = []
    for i, (n, at) in enumerate(zip(lens, arrivals, strict=True)):
        prompt = make_prompt(count_tokens, n, seed=spec.seed * 100003 + i)
        out.append(PlannedRequest(i, prompt, count_tokens(prompt), spec.output_len, at))
    return out
