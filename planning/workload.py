"""A workload as a user describes it: prompt and answer lengths, arrival rate, latency targets.

Lengths are distributions written the way people say them: `512` (always), `300-1000` (uniform),
`lognormal:500:0.8` (median 500 tokens, sigma 0.8 of the log; optional `:MAX`), or a list of
observed lengths (sampled with replacement). Arrivals are Poisson. A workload reads from a YAML
file (`tandem plan --workload FILE`) or from flags; both go through `Workload.from_dict`.

    rate: 0.6                    # requests per second
    prompt: 300-1000             # prompt tokens
    output: 64                   # answer tokens
    targets:
      ttft: {seconds: 0.5, percentile: 90}
      itl: {seconds: 0.05, percentile: 99}
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Request:
    id: int
    t: float  # arrival, seconds since the start
    prompt: int  # tokens
    output: int  # tokens to generate (>= 1)
    kind: str


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts: fixed, uniform, lognormal (capped) or empirical."""

    kind: str  # fixed | uniform | lognormal | samples
    params: tuple[float, ...]

    def draw(self, rng: random.Random) -> int:
        p = self.params
        if self.kind == "fixed":
            return int(p[0])
        if self.kind == "uniform":
            return rng.randint(int(p[0]), int(p[1]))
        if self.kind == "lognormal":
            value = int(round(p[0] * math.exp(rng.gauss(0.0, p[1]))))
            return max(1, min(value, int(p[2]))) if len(p) > 2 else max(1, value)
        return int(rng.choice(p))

    def quantile(self, q: float, samples: int = 20000, seed: int = 7) -> float:
        """The q-quantile (exact for fixed and uniform, sampled otherwise)."""
        if self.kind == "fixed":
            return self.params[0]
        if self.kind == "uniform":
            return self.params[0] + q * (self.params[1] - self.params[0])
        rng = random.Random(seed)
        draws = sorted(self.draw(rng) for _ in range(samples))
        return float(draws[min(len(draws) - 1, int(q * len(draws)))])

    def mean(self, samples: int = 20000, seed: int = 7) -> float:
        if self.kind == "fixed":
            return self.params[0]
        if self.kind == "uniform":
            return (self.params[0] + self.params[1]) / 2
        if self.kind == "samples":
            return sum(self.params) / len(self.params)
        rng = random.Random(seed)
        return sum(self.draw(rng) for _ in range(samples)) / samples

    def describe(self) -> str:
        p = [f"{x:g}" for x in self.params]
        if self.kind == "fixed":
            return f"{p[0]} tokens"
        if self.kind == "uniform":
            return f"{p[0]}-{p[1]} tokens (uniform)"
        if self.kind == "lognormal":
            return f"lognormal, median {p[0]} tokens, sigma {p[1]}" + (f", at most {p[2]}" if len(p) > 2 else "")
        return f"{len(self.params)} observed lengths, mean {self.mean():.0f}"


def parse_lengths(value: Any, what: str) -> Lengths:
    """`512`, `300-1000`, `lognormal:MEDIAN:SIGMA[:MAX]` or a list of lengths; ValueError otherwise."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        counts = tuple(float(_positive(v, what)) for v in value)
        if not counts:
            raise ValueError(f"{what}: the list of lengths is empty")
        return Lengths("samples", counts)
    text = str(value).strip()
    try:
        if text.startswith("lognormal:"):
            parts = [float(x) for x in text.split(":")[1:]]
            if len(parts) not in (2, 3) or parts[0] < 1 or parts[1] <= 0 or (len(parts) == 3 and parts[2] < 1):
                raise ValueError
            return Lengths("lognormal", tuple(parts))
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            if not 1 <= lo <= hi:
                raise ValueError
            return Lengths("uniform", (float(lo), float(hi)))
        return Lengths("fixed", (float(_positive(text, what)),))
    except ValueError:
        raise ValueError(f"{what}: {value!r} is not a length: write N, LOW-HIGH, lognormal:MEDIAN:SIGMA[:MAX] "
                         "or a list of lengths (tokens, at least 1)") from None


def _positive(value: Any, what: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError(f"{what}: lengths are at least 1 token, got {value!r}")
    return n


@dataclass(frozen=True)
class Target:
    seconds: float
    percentile: float  # 50-99.9, as spec.autoscaling.targets

    @property
    def quantile(self) -> float:
        return self.percentile / 100.0

    def describe(self) -> str:
        return f"p{self.percentile:g} <= {_ms(self.seconds)}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second (Poisson)
    prompt: Lengths
    output: Lengths
    ttft: Target
    itl: Target

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        """From `tandem plan`'s workload YAML (or its flags, gathered the same way)."""
        unknown = set(d) - {"rate", "prompt", "output", "targets"}
        if unknown:
            raise ValueError(f"workload: unknown keys {sorted(unknown)} (rate, prompt, output, targets)")
        for key in ("rate", "prompt", "output"):
            if key not in d:
                raise ValueError(f"workload: {key} is required")
        rate = float(d["rate"])
        if not rate > 0:
            raise ValueError(f"workload: rate must be above 0 requests/s, got {d['rate']!r}")
        targets = d.get("targets") or {}
        return cls(rate, parse_lengths(d["prompt"], "prompt"), parse_lengths(d["output"], "output"),
                   _target(targets.get("ttft"), "ttft", 2.0), _target(targets.get("itl"), "itl", 0.1))

    def within(self, fraction: float) -> Workload:
        """The same workload held to `fraction` of its latency targets (headroom under them)."""
        return replace(self, ttft=replace(self.ttft, seconds=self.ttft.seconds * fraction),
                       itl=replace(self.itl, seconds=self.itl.seconds * fraction))

    def describe(self) -> str:
        return (f"{self.rate:g} requests/s (Poisson), prompts {self.prompt.describe()}, answers "
                f"{self.output.describe()}; targets TTFT {self.ttft.describe()}, ITL {self.itl.describe()}")

    def trace(self, duration_s: float, seed: int = 0) -> Iterator[Request]:
        """Poisson arrivals over duration_s with lengths drawn from the distributions."""
        rng = random.Random(seed)
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(self.rate)
            if t >= duration_s:
                return
            yield Request(i, t, self.prompt.draw(rng), self.output.draw(rng), "workload")
            i += 1


def _target(value: Any, name: str, default_s: float) -> Target:
    """As spec.autoscaling.targets: {seconds, percentile (default 90)}; seconds > 0, percentile 50-99.9."""
    value = value or {}
    seconds, percentile = float(value.get("seconds", default_s)), float(value.get("percentile", 90))
    if not seconds > 0 or not 50 <= percentile <= 99.9:
        raise ValueError(f"targets.{name}: seconds must be above 0 and percentile within 50-99.9, got {value!r}")
    return Target(seconds, percentile)
