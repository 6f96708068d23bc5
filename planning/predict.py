"""What a fixed fleet would show under a workload: the simulator (simulation.py) run on a steady
Poisson trace of it, read as a user reads a benchmark (TTFT and pooled token gaps, at the
workload's percentiles and at the median)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from tandem.planning.capacity import Capacity
from tandem.planning.simulation import Simulation
from tandem.planning.workload import Workload

# Gap buckets 5% apart from 1 ms to 60 s: a percentile read through them is within 5% of exact.
FINE_BOUNDS = (*(0.001 * 1.05 ** i for i in range(226)), math.inf)
WARM_UP_FRACTION = 0.1  # the first requests meet an empty fleet: left out of the percentiles


class Layout(enum.StrEnum):
    """How the workers share the work."""

    DISAGGREGATED = "disaggregated"  # prefill workers prefill, decode workers decode
    COLOCATED = "colocated"  # no prefill worker: every worker prefills its prompts in chunks beside its streams


@dataclass(frozen=True)
class Fleet:
    layout: Layout
    prefill: int
    decode: int
    decode_chunk: int | None  # prompt tokens per step a decode worker prefills beside its streams

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def describe(self) -> str:
        chunk = f", prompts prefilled {self.decode_chunk} tokens a step" if self.decode_chunk else ""
        if self.layout is Layout.COLOCATED:
            return f"{self.decode} colocated worker{'s' * (self.decode != 1)}{chunk}"
        return f"{self.prefill} prefill + {self.decode} decode worker{'s' * (self.workers != 1)}"


@dataclass(frozen=True)
class Prediction:
    requests: int  # finished, after the warm-up
    ttft_p50: float
    ttft_q: float  # at the workload's TTFT percentile
    itl_p50: float
    itl_q: float  # at the workload's ITL percentile
    tokens_per_s: float  # output tokens over the run
    prefill_busy: float  # mean busy fraction of a prefill worker (disaggregated), else 0

    def misses(self, wl: Workload) -> tuple[bool, bool]:
        """(TTFT missed, ITL missed) against the workload's targets."""
        return self.ttft_q > wl.ttft.seconds, self.itl_q > wl.itl.seconds

    def worst_ratio(self, wl: Workload) -> float:
        return max(self.ttft_q / wl.ttft.seconds, self.itl_q / wl.itl.seconds)


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else math.nan


def predict(cap: Capacity, wl: Workload, fleet: Fleet, *, requests: int = 2000, seed: int = 0) -> Prediction:
    """Simulates `requests` arrivals of the workload on the fleet, fixed in size."""
    duration = max(60.0, requests / wl.rate)
    sim = Simulation(cap, wl.trace(duration, seed), lambda s, now: {},
                     {"prefill": fleet.prefill, "decode": fleet.decode}, interval_s=duration, day_s=duration,
                     ttft_slo=wl.ttft.seconds, tpot_slo=wl.itl.seconds, ttft_bounds=FINE_BOUNDS,
                     itl_bounds=FINE_BOUNDS, seed=seed, decode_chunk_tokens=fleet.decode_chunk).run()
    ttft = list(sim.outcomes.ttft)[int(WARM_UP_FRACTION * len(sim.outcomes.ttft)):]
    itl = sim.itl_hist.frozen()
    made = sum(r.gen_tokens for role in sim.replicas.values() for r in role.values())
    busy = [r.busy_s / duration for r in sim.replicas["prefill"].values()]
    return Prediction(requests=len(ttft), ttft_p50=_quantile(ttft, 0.5), ttft_q=_quantile(ttft, wl.ttft.quantile),
                      itl_p50=itl.quantile(0.5) or 0.0, itl_q=itl.quantile(wl.itl.quantile) or 0.0,
                      tokens_per_s=made / duration, prefill_busy=sum(busy) / len(busy) if busy else 0.0)
