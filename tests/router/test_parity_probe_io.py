"""One parity probe's calls against scripted workers (tandem.testing.fake_workers): what it sends
(teacher-forced continuation, logprobs, a salt per path, the handoff's first token), how it reads
the answers, and that a probe that fails part way frees what it left (the prefill lease, the
decode sequence) and reports an error instead of raising; the checker takes one disagreement for
noise only when a second probe agrees."""

from __future__ import annotations

import asyncio

from tandem.contracts.handoff_parity import ProbeOutcome
from tandem.contracts.kv_source import KVSource
from tandem.contracts.names import Role
from tandem.contracts.protocol import EventType, FinishReason, PrefillResult, StreamEvent
from tandem.router.parity.decisions import UNKNOWN_DTYPE_TOLERANCE, Pair, probe_tokens
from tandem.router.parity.probe import run_probe
from tandem.router.policies.base import WorkerView
from tandem.router.worker_client import HandoffDiverged
from tandem.testing.fake_workers import Call, FakeWorkers, busy, died, finish, start

P, D = "http://p", "http://d"
SEED = 11
PROMPT, CONT = probe_tokens(SEED)
PAIR = Pair(WorkerView(P, Role.PREFILL, "g1", dtype="float32"), WorkerView(D, Role.DECODE, "g1", dtype="float32"),
            frozenset({P, D}))


def scored(tokens: list[int], lps: list[float]) -> list[StreamEvent]:
    return [StreamEvent(EventType.TOKEN, token_ids=[t], text="x", logprobs=[{"id": t, "token": "x", "logprob": lp}])
            for t, lp in zip(tokens, lps, strict=True)]


def prefilled(lp: float) -> PrefillResult:
    kv = KVSource(P, "p-1", "tcp", list(range(6)), len(PROMPT), lease_token="lease-1")
    return PrefillResult("rid", list(PROMPT), CONT[0], "x", None, kv,
                         first_token_logprobs={"id": CONT[0], "token": "x", "logprob": lp})


def workers(alone: list[float], handoff: list[float]) -> FakeWorkers:
    w = FakeWorkers()
    w.on_generate(D, [start(len(PROMPT)), *scored(CONT, alone), finish(FinishReason.LENGTH)])
    w.on_prefill(P, prefilled(handoff[0]))
    w.on_generate(D, [start(len(PROMPT)), *scored(CONT[1:], handoff[1:]), finish(FinishReason.LENGTH)])
    return w


def probe(w: FakeWorkers, tolerance: float = 1e-4):
    return asyncio.run(run_probe(w, PAIR, tolerance, timeout_s=5, seed=SEED))


def test_the_probe_sends_the_forced_continuation_down_both_paths_and_agrees():
    lps = [-1.0 - i / 8 for i in range(len(CONT))]
    w = workers(lps, lps)
    result = probe(w)
    assert (result.outcome, result.max_abs_diff, result.seed, result.tokens) == (ProbeOutcome.MATCH, 0.0, SEED, 8)
    alone, handoff = w.made("generate")
    (pre,) = w.made("prefill")
    for call in (alone, pre, handoff):
        assert call.request.prompt_token_ids == PROMPT
        s = call.request.sampling
        assert (s.forced_token_ids, s.logprobs, s.temperature, s.max_tokens) == (CONT, 0, 0.0, 8)
        assert s.ignore_eos
    assert alone.url == handoff.url == D and pre.url == P
    assert handoff.request.kv_source.lease_token == "lease-1" and handoff.request.generated_token_ids == CONT[:1]
    assert handoff.request.request_id == pre.request.request_id != alone.request.request_id
    assert pre.request.cache_salt == handoff.request.cache_salt != alone.request.cache_salt
    assert alone.request.cache_salt and w.aborts == []


def test_a_difference_in_the_first_token_alone_is_caught():
    lps = [-1.0] * len(CONT)
    result = probe(workers(lps, [-2.5, *lps[1:]]))
    assert result.outcome is ProbeOutcome.MISMATCH and result.max_abs_diff == 1.5
    assert "continuation token 0" in result.message


def test_a_decode_worker_that_dies_in_the_handoff_frees_the_lease_and_its_copy():
    w = FakeWorkers()
    w.on_generate(D, [start(len(PROMPT)), *scored(CONT, [-1.0] * 8), finish(FinishReason.LENGTH)])
    w.on_prefill(P, prefilled(-1.0))
    w.on_generate(D, [start(len(PROMPT)), died("connection reset")])
    result = probe(w)
    assert result.outcome is ProbeOutcome.ERROR and "connection reset" in result.message
    rid = w.made("prefill")[0].request.request_id
    assert sorted(zip(w.aborts, w.abort_tokens, strict=True)) == [((D, rid), None), ((P, rid), "lease-1")]


def test_a_busy_prefill_worker_is_an_error_to_retry_not_a_verdict():
    w = FakeWorkers()
    w.on_generate(D, [start(len(PROMPT)), *scored(CONT, [-1.0] * 8), finish(FinishReason.LENGTH)])
    w.on_prefill(P, busy())
    result = probe(w)
    assert result.outcome is ProbeOutcome.ERROR and result.max_abs_diff is None and "busy" in result.message


def test_a_stream_that_ends_without_finish_or_with_an_error_line_is_an_error():
    for ending in ([], [StreamEvent(EventType.ERROR, error={"message": "engine_error"})]):
        w = FakeWorkers()
        w.on_generate(D, [start(len(PROMPT)), *scored(CONT[:3], [-1.0] * 3), *ending])
        result = probe(w)
        assert result.outcome is ProbeOutcome.ERROR, ending
        assert w.aborts == [(D, w.made("generate")[0].request.request_id)]


class EchoWorkers(FakeWorkers):
    """Workers that follow the probe's teacher forcing (whatever its seed) and score every token -1.0,
    the decode worker's handoff path shifted by the next of `shifts` (one per probe)."""

    def __init__(self, shifts: list[float]) -> None:
        super().__init__()
        self.shifts = shifts
        self.add(P, Role.PREFILL)
        self.add(D, Role.DECODE)

    async def prefill(self, url, request):
        self.calls.append(Call("prefill", url, request))
        first = request.sampling.forced_token_ids[0]
        kv = KVSource(P, "p-1", "tcp", [0], len(request.prompt_token_ids), lease_token="t")
        return PrefillResult(request.request_id, request.prompt_token_ids, first, "x", None, kv,
                             first_token_logprobs={"id": first, "token": "x", "logprob": -1.0})

    async def generate(self, url, request):
        self.calls.append(Call("generate", url, request))
        handoff = request.kv_source is not None
        shift = self.shifts.pop(0) if handoff else 0.0
        forced = request.sampling.forced_token_ids[len(request.generated_token_ids):]
        yield start(len(request.prompt_token_ids))
        for ev in scored(forced, [-1.0 + shift] * len(forced)):
            yield ev
        yield finish(FinishReason.LENGTH)


def _checked(workers: EchoWorkers) -> tuple[dict, list[str]]:
    from prometheus_client import CollectorRegistry
    from tandem.router.parity.checker import ParityChecker
    from tandem.router.workers import Target, WorkerSet

    async def main():
        pool = WorkerSet(workers)
        pool.set_targets([Target(P), Target(D)])
        checker = ParityChecker(workers, CollectorRegistry())
        checker.attach(pool)
        await pool.poll_once()
        assert await checker.settle(10)
        await checker.stop()
        return {w.url: w.state.value for w in checker.report().workers}, [w.last.message for w in
                                                                         checker.report().workers]

    return asyncio.run(main())


# The fake workers report no dtype: the probe judges them by UNKNOWN_DTYPE_TOLERANCE.
FIRST, SECOND = 1.5 * UNKNOWN_DTYPE_TOLERANCE, 1.75 * UNKNOWN_DTYPE_TOLERANCE


def test_one_disagreement_is_taken_for_noise_when_a_second_probe_agrees():
    states, _ = _checked(EchoWorkers(shifts=[FIRST, 0.0]))
    assert states == {P: "verified", D: "verified"}


def test_a_disagreement_that_repeats_is_a_mismatch():
    states, messages = _checked(EchoWorkers(shifts=[FIRST, SECOND]))
    assert states == {P: "mismatch", D: "mismatch"}
    assert all(f"{SECOND:.3g}" in m and f"confirmed by a second probe ({FIRST:.3g} the first time)" in m
               for m in messages)


class FleetWorkers(EchoWorkers):
    """Prefill and decode workers that follow the probe's teacher forcing; a decode worker in `broken`
    (other weights, say) scores every handed-off token off by 3 nats."""

    def __init__(self, prefill: list[str], decode: list[str], broken: set[str]) -> None:
        FakeWorkers.__init__(self)
        self.shifts, self.broken = [], broken
        for url in prefill:
            self.add(url, Role.PREFILL)
        for url in decode:
            self.add(url, Role.DECODE)

    async def generate(self, url, request):
        if request.kv_source is not None:
            self.shifts.append(-3.0 * UNKNOWN_DTYPE_TOLERANCE if url in self.broken else 0.0)
        async for ev in super().generate(url, request):
            yield ev


def test_a_prefill_worker_a_broken_decode_pod_dragged_into_mismatch_is_cleared_by_a_verified_one():
    """Issue 28 item 7, through the checker: four workers at start-up, the broken decode pod probed
    first; its prefill partner must end up VERIFIED with no recheck configured."""
    from prometheus_client import CollectorRegistry
    from tandem.router.parity.checker import ParityChecker
    from tandem.router.workers import Target, WorkerSet

    bad, p1, good, p2 = "http://a-bad", "http://b-p1", "http://c-good", "http://d-p2"
    workers = FleetWorkers([p1, p2], [bad, good], broken={bad})

    async def main():
        pool = WorkerSet(workers)
        pool.set_targets([Target(bad), Target(p1), Target(good), Target(p2)])  # first seen in this order
        checker = ParityChecker(workers, CollectorRegistry(), recheck_s=0.0)
        checker.attach(pool)
        await pool.poll_once()
        assert await checker.settle(10)
        await checker.stop()
        return {w.url: w.state.value for w in checker.report().workers}

    states = asyncio.run(main())
    assert states == {bad: "mismatch", p1: "verified", good: "verified", p2: "verified"}
    pairs = [(c.url, c.request.kv_source.url if c.request.kv_source else None) for c in workers.made("generate")]
    assert pairs[:2] == [(bad, None), (bad, P)], "the broken decode pod was probed first (with b-p1)"


# --- a runtime that cannot force tokens (vLLM): the handoff generates, the decode worker alone scores ---


def unforced(handoff: list[float], alone: list[float] | Exception) -> FakeWorkers:
    """The handoff path's greedy tokens are CONT (first from the prefill), with `handoff` logprobs;
    the decode worker scores them as `alone`."""
    w = FakeWorkers(forces_tokens=False)
    w.on_prefill(P, prefilled(handoff[0]))
    w.on_generate(D, [start(len(PROMPT)), *scored(CONT[1:], handoff[1:]), finish(FinishReason.LENGTH)])
    w.on_score(D, alone)
    return w


def test_without_forcing_the_decode_worker_alone_scores_exactly_the_handoffs_tokens():
    lps = [-1.0 - i / 8 for i in range(len(CONT))]
    w = unforced(lps, [lp + 1e-6 for lp in lps])
    result = probe(w)
    assert result.outcome is ProbeOutcome.MATCH and result.max_abs_diff < 1e-5
    (pre,), (handoff,) = w.made("prefill"), w.made("generate")
    for call in (pre, handoff):  # nothing forced: greedy, with the chosen tokens' logprobs
        s = call.request.sampling
        assert (s.forced_token_ids, s.logprobs, s.temperature, s.max_tokens) == (None, 0, 0.0, 8)
    ((url, ids, n, salt),) = w.scored
    assert (url, ids, n) == (D, PROMPT + CONT, 8)  # the prompt, then what the handoff chose
    assert salt and salt != pre.request.cache_salt and w.aborts == []


def test_without_forcing_a_handoff_that_scores_otherwise_is_caught():
    lps = [-1.0] * len(CONT)
    result = probe(unforced(lps, [*lps[:5], -7.0, *lps[6:]]))
    assert result.outcome is ProbeOutcome.MISMATCH and result.max_abs_diff == 6.0
    assert "continuation token 5" in result.message


def test_a_decode_that_diverges_from_the_handoffs_first_token_is_a_mismatch():
    """vLLM's decode regenerates the prefill's first token from the KV it pulled: another token there
    is the pairing disagreeing, not a worker failing."""
    w = FakeWorkers(forces_tokens=False)
    w.on_prefill(P, prefilled(-1.0))
    w.on_generate(D, [start(len(PROMPT)), HandoffDiverged("vLLM generated token 9 where the client already has 5")])
    result = probe(w)
    assert result.outcome is ProbeOutcome.MISMATCH and result.max_abs_diff == float("inf")
    assert "the handoff's tokens differ" in result.message and "token 9" in result.message


def test_without_forcing_a_decode_worker_that_cannot_score_is_an_error_not_a_verdict():
    result = probe(unforced([-1.0] * len(CONT), died("scoring failed")))
    assert result.outcome is ProbeOutcome.ERROR and "scoring failed" in result.message
