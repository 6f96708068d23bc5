"""A day-shaped arrival trace with mixed prompt and answer lengths, reproducible from a seed.

Arrivals are a Poisson process whose rate follows a working day (a night trough at a tenth of the
peak, a morning hump, the peak mid-afternoon, an evening hump) with one 15-minute flash crowd
(+40%) late morning. The mix moves through the day so prefill and decode demand do not rise
together: document prompts (long in, short out) are most of the office hours, long answers (short
in, long out) most of the evening, chat in between. `day_s` compresses the day (the shape and the
mix keep their hours).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from tandem.planning.workload import Request


def _bump(h: float, centre: float, width: float) -> float:
    return math.exp(-0.5 * ((h - centre) / width) ** 2)


def _raw(h: float) -> float:
    return 0.12 + 0.7 * _bump(h, 10.5, 2.0) + 0.95 * _bump(h, 15.0, 2.2) + 0.75 * _bump(h, 20.5, 1.8)


_PEAK = max(_raw(h / 60.0) for h in range(24 * 60))
BURST = (11.0, 11.25, 1.4)  # from hour, to hour, factor


def load_shape(hour: float) -> float:
    """Arrival rate as a fraction of the peak (the flash crowd excepted), hour in [0, 24)."""
    base = _raw(hour % 24.0) / _PEAK
    return base * (BURST[2] if BURST[0] <= hour % 24.0 < BURST[1] else 1.0)


def mix(hour: float) -> dict[str, float]:
    """Share of each request kind at this hour."""
    office = _bump(hour, 12.5, 3.0)
    evening = _bump(hour, 21.0, 2.0)
    w = {"chat": 0.5, "document": 0.1 + 0.9 * office, "long-answer": 0.1 + 0.8 * evening}
    total = sum(w.values())
    return {k: v / total for k, v in w.items()}


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def sample_lengths(rng: random.Random, kind: str) -> tuple[int, int]:
    """(prompt tokens, output tokens) for one request of this kind (within the model's 2048)."""
    if kind == "chat":
        return _log_uniform(rng, 64, 512), _log_uniform(rng, 32, 256)
    if kind == "document":
        return rng.randint(512, 1024), _log_uniform(rng, 16, 96)
    return _log_uniform(rng, 32, 256), rng.randint(256, 512)


def mean_lengths(hour: float, samples: int = 4000, seed: int = 1) -> tuple[float, float]:
    """Mean prompt and output tokens of the mix at this hour (by sampling)."""
    rng = random.Random(seed)
    m = mix(hour)
    kinds = list(m)
    p = o = 0
    for _ in range(samples):
        kind = rng.choices(kinds, weights=[m[k] for k in kinds])[0]
        a, b = sample_lengths(rng, kind)
        p, o = p + a, o + b
    return p / samples, o / samples


GRID = 24 * 60  # the shape and the mix are looked up per minute of the day
_SHAPE = [load_shape(i / 60.0) for i in range(GRID)]
_KINDS = ("chat", "document", "long-answer")
_CUM_MIX = []
for _i in range(GRID):
    _m = mix(_i / 60.0)
    _CUM_MIX.append((_m["chat"], _m["chat"] + _m["document"]))


def day(peak_rps: float, day_s: float = 86400.0, seed: int = 0) -> Iterator[Request]:
    """Requests of one day in arrival order: a Poisson process thinned to the day's shape."""
    rng = random.Random(seed)
    top = peak_rps * BURST[2]
    t, i = 0.0, 0
    per_minute = day_s / GRID
    while True:
        t += rng.expovariate(top)
        if t >= day_s:
            return
        minute = min(GRID - 1, int(t / per_minute))
        if rng.random() * top > peak_rps * _SHAPE[minute]:
            continue
        u, (a, b) = rng.random(), _CUM_MIX[minute]
        kind = _KINDS[0] if u < a else _KINDS[1] if u < b else _KINDS[2]
        prompt, output = sample_lengths(rng, kind)
        yield Request(i, t, prompt, output, kind)
        i += 1
