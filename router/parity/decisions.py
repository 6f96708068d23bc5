"""The handoff parity check's decisions, pure: the probe's fixed tokens, how two scorings compare,
which pairing to probe next, and what a result means for each worker.

A handoff that looks healthy can still serve wrong text: a decode worker whose weights differ from
the prefill worker's (a node-local path, a corrupted volume), a transport or KV layout bug that moves
the bytes of the wrong heads or blocks. The router proves every pairing before it hands KV across it
(router/parity/checker.py runs the probes, router/parity/probe.py does the I/O of one): a fixed
prompt goes through prefill-then-decode (KV pulled over the real transport) and through the decode
worker alone, each teacher-forced through a fixed continuation, and the log probabilities of that
continuation must agree within the tolerance for the workers' dtype.

Per worker (tandem.contracts.handoff_parity.ParityState): a new worker is UNCHECKED until a probe
with a worker of the other role in its kv_compat agrees (VERIFIED). A probe that disagrees marks
MISMATCH every worker in it that was not already proven by another probe: a verified partner
isolates the odd one out; two new workers are both suspect, and a suspect is probed again as soon as
a worker of the other role is VERIFIED (one broken pod at start-up must not shut its partner out for
good). A MISMATCH is re-probed only against a VERIFIED partner; every verdict is probed again
`recheck_s` after it was reached. Only VERIFIED workers take part in a handoff (policies/base.py);
the others still serve requests they prefill themselves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.contracts.handoff_parity import (
    RECHECK_S,
    ParityReport,
    ParityState,
    ProbeOutcome,
    ProbeResult,
    WorkerParity,
)
from tandem.contracts.names import Role
from tandem.router.policies.base import WorkerView

# The probe: token ids every served vocabulary has (>= 256 entries; 0-2 are often special), a
# prompt of several KV blocks (block order matters to a layout bug) and 8 continuation tokens, drawn
# from a seed per probe (kept in the result), so no probe finds an earlier one's KV in a prefix cache.
PROBE_PROMPT_TOKENS = 96
PROBE_CONTINUATION_TOKENS = 8


def probe_tokens(seed: int) -> tuple[list[int], list[int]]:
    """(prompt, continuation) of the probe with this seed."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, 256) for _ in range(PROBE_PROMPT_TOKENS + PROBE_CONTINUATION_TOKENS)]
    return ids[:PROBE_PROMPT_TOKENS], ids[PROBE_PROMPT_TOKENS:]


# Largest |logprob difference| (nats) two paths may show for the same tokens. Idle, identical kernels
# give exactly 0; a batch shared with other requests changes the kernels' shapes and so the rounding:
# measured on the ~42M engine model beside 8 streams (`python -m bench parity_probe`, 2 runs of 40
# probes), at most 1e-5 in float32 and up to 0.35 in bfloat16 (in 1 probe of 10); other weights
# differ by 5 to 18. float16 keeps 3 more mantissa bits than bfloat16 (about 8x less rounding). A
# disagreement counts only once a second probe confirms it (checker.py).
TOLERANCE = {"float32": 1e-4, "float16": 0.25, "bfloat16": 1.0}
UNKNOWN_DTYPE_TOLERANCE = 1.0


def tolerance_for(dtype: str, override: float | None = None) -> float:
    """The configured tolerance, else the one for the workers' dtype."""
    if override is not None:
        return override
    return TOLERANCE.get(dtype, UNKNOWN_DTYPE_TOLERANCE)


@dataclass(frozen=True)
class Scored:
    """One continuation token as a path scored it."""

    token_id: int
    logprob: float


def compare(handoff: Sequence[Scored], alone: Sequence[Scored], tolerance: float,
            continuation: Sequence[int]) -> tuple[ProbeOutcome, float | None, str]:
    """(outcome, max |difference|, message) of the two scorings of `continuation`."""
    want = list(continuation)
    for name, path in (("prefill-then-decode", handoff), ("decode alone", alone)):
        if [s.token_id for s in path] != want:
            got = [s.token_id for s in path]
            return ProbeOutcome.ERROR, None, (f"the {name} path returned tokens {got}, not the forced "
                                              f"continuation {want} (a worker without teacher forcing?)")
    # a NaN (a broken model or transport) compares as the largest difference there is
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(handoff, alone, strict=True)]
    diffs = [math.inf if math.isnan(d) else d for d in diffs]
    worst = max(diffs, default=0.0)
    at = diffs.index(worst) if diffs else 0
    summary = (f"max |logprob difference| {worst:.3g} over {len(want)} tokens "
               f"(tolerance {tolerance:g}")
    if worst <= tolerance:
        return ProbeOutcome.MATCH, worst, summary + ")"
    return ProbeOutcome.MISMATCH, worst, (f"{summary}); first at continuation token {at}: "
                                          f"{handoff[at].logprob:.4f} after the handoff, "
                                          f"{alone[at].logprob:.4f} on the decode worker alone")


def prefill_side(v: WorkerView) -> bool:
    return v.role is Role.PREFILL


@dataclass(frozen=True)
class Pair:
    """One probe to run: a prefill and a decode-capable worker of one kv_compat, and which of them
    the result speaks for (a partner already verified with another worker is not)."""

    prefill: WorkerView
    decode: WorkerView
    subjects: frozenset[str]


@dataclass
class _Worker:
    role: Role
    kv_compat: str
    engine_id: str = ""  # "" until the worker answered /internal/info
    state: ParityState = ParityState.UNCHECKED
    checking: bool = False
    last: ProbeResult | None = None
    due: float = 0.0  # monotonic time of its next probe (retry or recheck); 0: now
    failures: int = 0  # probes in a row that could not finish (the backoff grows with them)
    suspect: bool = False  # MISMATCH with an unproven partner: the fault may be the partner's


_PARTNER_RANK = {ParityState.VERIFIED: 0, ParityState.UNCHECKED: 1, ParityState.FAILED: 2, ParityState.MISMATCH: 3}
_DUE_RANK = {ParityState.UNCHECKED: 0, ParityState.FAILED: 1, ParityState.MISMATCH: 2, ParityState.VERIFIED: 3}


@dataclass
class ParityTable:
    """Every worker's standing, and the choice of the next probe."""

    recheck_s: float = RECHECK_S  # a worker is probed again this long after its last verdict (0: never)
    retry_s: float = 2.0  # after a probe that could not finish; doubles per failure, up to max_retry_s
    max_retry_s: float = 60.0
    workers: dict[str, _Worker] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)  # probes by outcome

    def update(self, views: Sequence[WorkerView]) -> None:
        """Follow the router's workers: new ones start UNCHECKED, gone ones are forgotten, and one
        whose role, kv_compat or engine changed (a restart, a new pod on an old address) starts over."""
        seen = {v.url: v for v in views if prefill_side(v) or v.serves_decode}
        for url in [u for u in self.workers if u not in seen]:
            del self.workers[url]
        for url, v in seen.items():
            w = self.workers.get(url)
            if w is None or (w.role, w.kv_compat) != (v.role, v.kv_compat) or (
                    v.engine_id and w.engine_id != v.engine_id):
                self.workers[url] = _Worker(v.role, v.kv_compat, v.engine_id)

    def state(self, url: str) -> ParityState | None:
        w = self.workers.get(url)
        return w.state if w is not None else ParityState.UNCHECKED

    def _waiting(self, w: _Worker) -> bool:
        """Whether a probe of this worker is scheduled: a retry after a failed probe, a suspect's
        second chance, or a recheck."""
        return (w.state is ParityState.FAILED or w.suspect
                or (self.recheck_s > 0 and w.state is not ParityState.UNCHECKED))

    def _due(self, v: WorkerView, now: float) -> bool:
        w = self.workers.get(v.url)
        if w is None or w.checking or not v.ready:
            return False
        return w.state is ParityState.UNCHECKED or (self._waiting(w) and w.due <= now)

    def _partners(self, v: WorkerView, views: Sequence[WorkerView]) -> list[WorkerView]:
        """Who `v` may be probed with: ready, of its kv_compat, of the other role, not being probed;
        only VERIFIED ones for a worker in MISMATCH (another suspect could not clear it)."""
        verified_only = self.workers[v.url].state is ParityState.MISMATCH
        return [p for p in views if p.ready and p.kv_compat == v.kv_compat and p.url in self.workers
                and not self.workers[p.url].checking
                and (p.serves_decode if prefill_side(v) else prefill_side(p))
                and (not verified_only or self.workers[p.url].state is ParityState.VERIFIED)]

    def next_pair(self, views: Sequence[WorkerView], now: float) -> Pair | None:
        """The next probe: the most urgent due worker (new ones first) that has a ready partner of the
        other role in its kv_compat; None when there is nothing to probe now."""
        due = sorted((v for v in views if v.url in self.workers and self._due(v, now)),
                     key=lambda v: (_DUE_RANK[self.workers[v.url].state], v.first_seen, v.url))
        for v in due:
            partners = self._partners(v, views)
            if not partners:
                continue
            partner = min(partners, key=lambda p: (_PARTNER_RANK[self.workers[p.url].state], p.first_seen, p.url))
            subjects = {v.url} | ({partner.url} if self.workers[partner.url].state is not ParityState.VERIFIED
                                  else set())
            prefill, decode = (v, partner) if prefill_side(v) else (partner, v)
            return Pair(prefill, decode, frozenset(subjects))
        return None

    def next_due(self, now: float) -> float | None:
        """The soonest time after `now` (monotonic) a retry or recheck falls due (None: none is
        scheduled). One already due but without a partner waits for the next poll, not a busy loop."""
        times = [w.due for w in self.workers.values() if not w.checking and self._waiting(w) and w.due > now]
        return min(times) if times else None

    def begin(self, pair: Pair) -> None:
        for url in (pair.prefill.url, pair.decode.url):
            if url in self.workers:
                self.workers[url].checking = True

    def finish(self, pair: Pair, result: ProbeResult, now: float) -> None:
        """Apply a probe's result to the workers it speaks for (see the module docstring)."""
        self.totals[result.outcome.value] = self.totals.get(result.outcome.value, 0) + 1
        for url in (pair.prefill.url, pair.decode.url):
            w = self.workers.get(url)
            if w is None:
                continue  # gone while it was probed
            w.checking = False
            if result.outcome is ProbeOutcome.MATCH:
                w.state, w.last, w.failures, w.due = ParityState.VERIFIED, result, 0, self._recheck(now)
                w.suspect = False
            elif url not in pair.subjects:
                continue  # proven with another worker: this result does not speak for it
            elif result.outcome is ProbeOutcome.MISMATCH:
                w.state, w.last, w.failures = ParityState.MISMATCH, result, 0
                # two unproven workers: either may be at fault, so this one waits for a VERIFIED partner
                w.suspect = len(pair.subjects) > 1
                w.due = now if w.suspect else self._recheck(now)
            else:
                w.failures += 1
                w.due = now + min(self.max_retry_s, self.retry_s * 2 ** (w.failures - 1))
                if w.state is ParityState.UNCHECKED or w.state is ParityState.FAILED:
                    w.state, w.last = ParityState.FAILED, result

    def _recheck(self, now: float) -> float:
        return now + self.recheck_s if self.recheck_s > 0 else 0.0

    def settled(self, views: Sequence[WorkerView], now: float) -> bool:
        """Nothing is being probed and no new or suspect worker waits for a probe it could have now."""
        if any(w.checking for w in self.workers.values()):
            return False
        pair = self.next_pair(views, now)
        return pair is None or all(self.workers[u].state is not ParityState.UNCHECKED and not self.workers[u].suspect
                                   for u in pair.subjects)

    def counts(self) -> dict[ParityState, int]:
        out = dict.fromkeys(ParityState, 0)
        for w in self.workers.values():
            out[w.state] += 1
        return out

    def report(self, enabled: bool = True) -> ParityReport:
        workers = [WorkerParity(url, w.role.value, w.kv_compat, w.state, w.checking, w.last)
                   for url, w in sorted(self.workers.items())]
        return ParityReport(enabled, workers, dict(self.totals))
