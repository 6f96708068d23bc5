"""The request state machine as a pure step, `decide(journey, outcome) -> action`: the handoff and
every fault path (prefill retry and fallback, client vs worker 4xx, decode death and resume,
exhausted resumes, busy workers, the prompt limit, the early finish), each a few function calls
with no event loop and no workers (microseconds). The driver that performs these actions is
tested against fake workers in test_request_driver.py; migrations in
test_state_machine_migrates_streams.py."""

from __future__ import annotations

import pytest
from tandem.contracts.names import Role
from tandem.contracts.protocol import EventType, FinishReason, StreamEvent
from tandem.contracts.routing import RouteReason
from tandem.router.actions import Abort, DecodeOn, EndWithError, Finish, PrefillOn, Read, Wait, Why
from tandem.router.decide import decide
from tandem.router.errors import RouterError
from tandem.router.journey import Finished, Phase, Started, Tokens
from tandem.router.outcomes import Aborted, CallFailed, Prefilled, Rejected, Waited
from tandem.router.policies.base import Snapshot
from tandem.router.validation import Limits
from tandem.router.worker_client import WorkerBusy, WorkerFailed, classify
from tandem.testing.fake_workers import busy, died, fail, finish, prefilled, start, token
from tandem.testing.journeys import (
    IDS,
    PROMPT,
    arrive,
    feed,
    handed_off,
    pool,
    request,
    rules,
    worker,
)


def test_the_handoff_streams_every_token_once():
    workers = pool("p1", "d1")
    j, first = arrive(workers)
    assert isinstance(first, PrefillOn) and first.worker.url == "p1" and first.work == 13  # 49 chars / 4
    assert j.phase is Phase.PREFILL and j.route_reason is RouteReason.DISAGGREGATED and first.route_reason is None
    handoff = decide(j, Prefilled("p1", prefilled("p1", IDS, 7, "A")), Snapshot(workers))
    assert isinstance(handoff, DecodeOn) and handoff.worker.url == "d1" and handoff.queued == 0
    assert handoff.emit == (Started(5), Tokens([7], "A")) and handoff.route_reason is RouteReason.DISAGGREGATED
    # the decode worker replays the first token and continues after the text the client has
    greq = j.worker_request(decode=True)
    assert greq.kv_source is not None and greq.kv_source.url == "p1" and greq.generated_token_ids == [7]
    assert (greq.emitted_chars, greq.prompt, greq.prompt_token_ids, greq.migrated_from) == (1, None, IDS, None)
    assert j.lease_tokens == {"p1": "token-of-p1"}
    lines = feed(j, "d1", start(5), token(8, "B"), token(9, "C"), finish(FinishReason.LENGTH))
    assert [type(a) for a in lines] == [Read, Read, Read, Finish]
    assert [ev for a in lines for ev in a.emit] == [Tokens([8], "B", offset=1), Tokens([9], "C", offset=2),
                                                Finished("length", 5, 3)]
    assert j.done and not any(a.abort for a in [first, handoff, *lines])


def test_prefill_fails_retries_elsewhere_then_falls_back_to_decode_side_prefill():
    workers = pool("p1", "p2", "d1")
    j, first = arrive(workers)
    retry = decide(j, CallFailed(first.worker.url, died()), Snapshot(workers))
    assert isinstance(retry, PrefillOn) and retry.why is Why.RETRY and retry.worker.url == "p2"
    assert retry.abort == ("p1",) and retry.blame.error.dead and retry.blame.role == "prefill"
    fallback = decide(j, CallFailed("p2", fail(503, "not_ready", type_="service_unavailable")), Snapshot(workers))
    assert isinstance(fallback, DecodeOn) and fallback.why is Why.FALLBACK and fallback.worker.url == "d1"
    assert fallback.abort == ("p2",) and fallback.route_reason is RouteReason.PREFILL_FAILED
    assert fallback.queued == 13, "the prompt waits on the decode worker until its first token"
    greq = j.worker_request(decode=True)
    assert greq.kv_source is None and greq.generated_token_ids == [] and greq.prompt == PROMPT
    assert j.prefill_url is None and j.touched == ["p1", "p2", "d1"] and j.phase is Phase.DECODE


def test_prefill_attempts_are_bounded():
    workers = pool("p1", "p2", "d1")
    j, first = arrive(workers, r=rules(max_prefill_attempts=1))
    fallback = decide(j, CallFailed("p1", died()), Snapshot(workers))
    assert isinstance(fallback, DecodeOn) and fallback.why is Why.FALLBACK and j.touched == ["p1", "d1"]


def test_a_client_4xx_from_prefill_passes_through_unchanged():
    refusal = fail(400, "invalid_value", "max_tokens", message="max_tokens is too large for this prompt")
    assert isinstance(refusal, RouterError)
    j, _ = arrive(pool("p1", "p2", "d1"))
    action = decide(j, Rejected(refusal), Snapshot())
    assert isinstance(action, EndWithError) and action.error is refusal and action.route_reason is None
    assert j.phase is Phase.FAILED and j.touched == ["p1"]  # no retry, no decode


@pytest.mark.parametrize(("status", "code"), [
    (400, "kv_mismatch"), (400, "kv_backend_mismatch"), (400, "wrong_role"),
    (409, "duplicate_request_id"), (503, "not_ready"),
])
def test_worker_side_4xx_codes_are_worker_failures(status, code):
    failure = fail(status, code)
    assert isinstance(failure, WorkerFailed) and not failure.dead
    workers = pool("p1", "p2", "d1")
    j, _ = arrive(workers)
    assert decide(j, CallFailed("p1", failure), Snapshot(workers)).worker.url == "p2"


def test_failures_are_classified_by_status_code_and_param():
    assert isinstance(classify(400, {"error": {"param": "max_tokens"}}, "x"), RouterError)
    assert isinstance(classify(404, "not json", "x"), RouterError)
    for param in ("kv_source", "first_token_id", "generated_token_ids", "emitted_chars"):
        assert isinstance(classify(400, {"error": {"param": param}}, "x"), WorkerFailed)
    for status in (408, 429, 500, 503):
        failure = classify(status, {"error": {}}, "x")
        assert isinstance(failure, WorkerFailed) and not failure.dead


def test_a_refused_handoff_resumes_without_the_kv():
    workers = pool("p1", "d1")
    j, _ = handed_off(workers)
    (abort,) = feed(j, "d1", fail(400, "kv_mismatch", "kv_source"), workers=workers)
    assert isinstance(abort, Abort) and abort.url == "d1", "d1's copy is gone before it gets the resume"
    resume = decide(j, Aborted("d1"), Snapshot(workers))
    assert isinstance(resume, DecodeOn) and resume.why is Why.RESUME and resume.worker.url == "d1"
    assert resume.abort == ("p1",), "the lease nobody will pull is freed"
    greq = j.worker_request(decode=True)
    assert greq.kv_source is None and (greq.generated_token_ids, greq.emitted_chars) == ([7], 1)


def test_decode_dies_mid_stream_and_resumes_elsewhere_with_the_tokens_so_far():
    workers = pool("p1", "d1", "d2")
    j, _ = handed_off(workers)
    # token 9's text is held back by d1 (say, half a UTF-8 character) when it dies
    *_, resume = feed(j, "d1", start(5), token(8, "B"), token(9, ""), died(), workers=workers)
    assert isinstance(resume, DecodeOn) and resume.why is Why.RESUME and resume.worker.url == "d2"
    # p1's lease too: d1 may have died before it pulled the KV
    assert resume.abort == ("d1", "p1") and resume.blame.error.dead and "d1" in j.excluded
    greq = j.worker_request(decode=True)
    assert greq.kv_source is None and (greq.generated_token_ids, greq.emitted_chars) == ([7, 8, 9], 2)
    assert greq.prompt_token_ids == IDS
    actions = feed(j, "d2", start(5), token(10, "CD"), finish())
    assert [ev for a in actions for ev in a.emit] == [Tokens([10], "CD", offset=2), Finished("stop", 5, 4)]


def test_a_finish_that_says_abort_is_a_failure_after_its_tokens():
    workers = pool("p1", "d1", "d2")
    j, _ = handed_off(workers)
    line = StreamEvent(EventType.FINISH, token_ids=[8], text="B", finish_reason=FinishReason.ABORT)
    (action,) = feed(j, "d1", line, workers=workers)
    assert isinstance(action, Abort) and action.emit == (Tokens([8], "B", offset=1),) and not action.blame.error.dead


def test_resumes_are_bounded_then_a_502():
    workers = pool("p1", "d1", "d2", "d3")
    j, _ = handed_off(workers, r=rules(max_resumes=1))
    (resume,) = feed(j, "d1", died(), workers=workers)
    (gave_up,) = feed(j, resume.worker.url, died(), workers=workers)
    assert isinstance(gave_up, EndWithError) and gave_up.error.status == 502
    assert gave_up.error.body["error"]["code"] == "worker_failed" and j.phase is Phase.FAILED


def test_no_worker_left_to_resume_on_is_a_502():
    workers = pool("p1", "d1")
    j, _ = handed_off(workers)
    feed(j, "d1", start(5))
    (action,) = feed(j, "d1", died(), workers=workers)
    assert isinstance(action, EndWithError) and "no other could resume" in action.error.message


def test_a_worker_that_dies_after_its_last_token_is_finished_not_resumed():
    workers = pool("p1", "d1", "d2")
    j, _ = handed_off(workers, request(max_tokens=3))
    *_, done = feed(j, "d1", token(8, "B"), token(9, "C"), died(), workers=workers)
    assert isinstance(done, Finish) and done.emit == (Finished("length", 5, 3),) and done.abort == ("d1", "p1")
    assert j.touched == ["p1", "d1"]


def test_the_first_token_can_finish_the_request():
    workers = pool("p1", "d1")
    j, _ = arrive(workers)
    done = decide(j, Prefilled("p1", prefilled("p1", IDS, 7, "A", finish_reason=FinishReason.STOP)), Snapshot())
    assert isinstance(done, Finish) and done.emit == (Started(5), Tokens([7], "A"), Finished("stop", 5, 1))
    assert done.route_reason is RouteReason.DISAGGREGATED and j.done and j.touched == ["p1"]


def test_max_prompt_tokens_is_checked_as_soon_as_the_size_is_exact():
    limits = Limits(max_prompt_tokens=4)
    # token ids from the client (or the router's tokenizer): before any worker
    j, action = arrive(pool("p1", "d1"), request(limits=limits, prompt=IDS), rules(limits=limits))
    assert isinstance(action, EndWithError) and action.error.body["error"]["code"] == "context_length_exceeded"
    assert j.touched == []
    # a prefill worker tokenized it: refused with its lease token known, so the end frees it
    j, action = handed_off(pool("p1", "d1"), request(limits=limits), rules(limits=limits))
    assert isinstance(action, EndWithError) and action.error.status == 400 and action.route_reason is not None
    assert j.lease_tokens == {"p1": "token-of-p1"}
    # a decode-side prefill: the decode worker's START carries the count
    j, _ = arrive(pool("d1"), request(limits=limits), rules(limits=limits))
    (action,) = feed(j, "d1", start(5))
    assert isinstance(action, EndWithError) and action.error.body["error"]["code"] == "context_length_exceeded"


def test_a_worker_refusing_the_request_before_any_token_is_the_clients_400():
    bad = {"message": "stop is too long", "type": "invalid_request_error", "param": "stop", "code": None}
    j, _ = arrive(pool("d1"))
    (action,) = feed(j, "d1", StreamEvent(EventType.ERROR, error=bad))
    assert isinstance(action, EndWithError) and action.error.status == 400 and action.error.body == {"error": bad}
    j, _ = handed_off(pool("p1", "d1"))  # once the client has tokens it is the worker's failure
    (action,) = feed(j, "d1", StreamEvent(EventType.ERROR, error=bad))
    assert isinstance(action, Abort)


def test_no_ready_decode_worker_is_a_503():
    j, action = arrive(pool("p1"))
    assert isinstance(action, EndWithError) and action.error.status == 503 and action.error.headers["Retry-After"]
    assert j.touched == []


def test_the_configured_policy_is_the_one_asked():
    r = rules("round-robin")
    chosen = [arrive(pool("d1", "d2"), r=r, request_id=f"r{i}", turns={Role.DECODE: i})[1] for i in range(2)]
    assert [a.worker.url for a in chosen] == ["d1", "d2"], "the snapshot's cursor says whose turn it is"
    assert {a.route_reason for a in chosen} == {RouteReason.NO_PREFILL_WORKER}
    assert all(a.turns == (Role.DECODE,) for a in chosen), "each choice moves the decode pool's cursor on"


def test_heartbeats_are_not_tokens():
    j, _ = arrive(pool("d1"))
    beat = StreamEvent(EventType.HEARTBEAT)
    actions = feed(j, "d1", start(5), beat, beat, token(7, "A"), beat, finish())
    assert [ev for a in actions for ev in a.emit] == [Started(5), Tokens([7], "A"), Finished("stop", 5, 1)]


def test_the_client_never_sees_a_worker_address():
    """5xx messages say what failed, not where: addresses go to the log."""
    p, d = "http://10.1.2.3:8000", "http://10.4.5.6:8000"
    workers = (worker(p, Role.PREFILL), worker(d))
    j, _ = arrive(workers)
    decide(j, Prefilled(p, prefilled(p, IDS, 7, "A")), Snapshot(workers))
    (action,) = feed(j, d, died(f"generate on {d} failed: connection reset"), workers=workers)
    assert isinstance(action, EndWithError) and action.error.status == 502
    assert "10.1.2.3" not in str(action.error.body) and "10.4.5.6" not in str(action.error.body)


# --- busy workers (429, or 503 with Retry-After): alive and full, never taken for dead -----------


def test_429_and_503_with_retry_after_are_busy_not_dead():
    for failure in (busy(429, None), busy(429, "3"), busy(503, "2")):
        assert isinstance(failure, WorkerBusy) and not failure.dead
    assert busy(429, "3").retry_after_s == 3 and busy(429, "9999").retry_after_s == 60
    assert not isinstance(fail(503, "not_ready"), WorkerBusy)  # no Retry-After: a failure


def test_busy_prefill_workers_fall_back_to_decode_side_prefill_as_saturated():
    workers = pool("p1", "p2", "d1")
    j, _ = arrive(workers)
    retry = decide(j, CallFailed("p1", busy()), Snapshot(workers))
    fallback = decide(j, CallFailed("p2", busy(503, "2")), Snapshot(workers))
    assert retry.worker.url == "p2" and isinstance(fallback, DecodeOn) and fallback.worker.url == "d1"
    assert fallback.route_reason is RouteReason.PREFILL_SATURATED
    assert retry.abort == fallback.abort == (), "they refused it: nothing to abort"
    assert all(isinstance(a.blame.error, WorkerBusy) for a in (retry, fallback))


def test_a_busy_decode_worker_passes_the_same_handoff_to_another():
    workers = pool("p1", "d1", "d2")
    j, handoff = handed_off(workers)
    kv = j.kv
    (retry,) = feed(j, handoff.worker.url, busy(), workers=workers)
    assert isinstance(retry, DecodeOn) and retry.why is Why.RETRY and retry.worker.url == "d2"
    assert j.kv is kv and retry.abort == (), "the lease is still good: no re-prefill"
    assert j.worker_request(decode=True).generated_token_ids == [7] and j.failures == 0


def test_every_decode_worker_busy_before_any_token_is_a_503_with_retry_after():
    workers = pool("d1", "d2")
    j, _ = arrive(workers)
    (other,) = feed(j, "d1", busy(429, "4"), workers=workers)
    (action,) = feed(j, other.worker.url, busy(503, "2"), workers=workers)
    assert isinstance(action, EndWithError) and action.error.status == 503 and action.error.headers["Retry-After"] == "2"
    assert action.error.body["error"]["code"] == "server_overloaded" and j.phase is Phase.FAILED


def test_a_started_stream_waits_for_a_busy_decode_worker_then_continues_with_its_lease():
    workers = pool("p1", "d1")
    j, _ = handed_off(workers)
    (wait,) = feed(j, "d1", busy(429, "1"), workers=workers, now=100.0)
    assert isinstance(wait, Wait) and wait.seconds == 1.0
    again = decide(j, Waited(now=101.0), Snapshot(workers))
    assert isinstance(again, DecodeOn) and again.worker.url == "d1" and j.kv is not None and not j.busy


def test_a_started_stream_gives_up_on_busy_workers_after_busy_wait_s():
    workers = pool("p1", "d1")
    j, _ = handed_off(workers, r=rules(busy_wait_s=3))
    (wait,) = feed(j, "d1", busy(429, "2"), workers=workers, now=100.0)
    decide(j, Waited(now=102.0), Snapshot(workers))
    (action,) = feed(j, "d1", busy(429, "2"), workers=workers, now=102.0)
    assert isinstance(wait, Wait) and isinstance(action, EndWithError) and action.error.status == 503
    assert "stayed busy" in action.error.message


# --- KV of one kv_compat never reaches another (issue 21, defect 1) -----------------------------


def test_a_busy_decode_worker_hands_the_lease_only_to_the_prefill_workers_kv_compat():
    workers = pool("p1", "d1", "d2@g2", "d3")
    j, handoff = handed_off(workers)
    (retry,) = feed(j, handoff.worker.url, busy(), workers=workers)
    assert retry.worker.url == "d3" and j.kv is not None and retry.abort == ()
    assert j.worker_request(decode=True).kv_source.url == "p1"


def test_a_busy_decode_worker_with_only_another_kv_compat_free_is_recomputed_there():
    workers = pool("p1", "d1", "d2@g2")
    j, _ = handed_off(workers)
    (retry,) = feed(j, "d1", busy(), workers=workers)
    assert isinstance(retry, DecodeOn) and retry.worker.url == "d2" and retry.worker.kv_compat == "g2"
    greq = j.worker_request(decode=True)
    assert greq.kv_source is None and greq.generated_token_ids == [7] and greq.emitted_chars == 1
    assert retry.abort == ("p1",), "nobody will pull that lease: freed at once"
    assert retry.queued == 0, "the client has its first token: no prompt queued as a prefill there"


def test_after_a_busy_wait_the_lease_still_goes_only_to_its_kv_compat():
    workers = pool("p1", "d1")
    j, _ = handed_off(workers)
    (wait,) = feed(j, "d1", busy(429, "1"), workers=workers, now=100.0)
    assert isinstance(wait, Wait) and j.kv is not None
    later = pool("p1", "d9@g2")  # d1 left meanwhile; only another kv_compat is ready
    again = decide(j, Waited(now=101.0), Snapshot(later))
    assert isinstance(again, DecodeOn) and again.worker.url == "d9" and j.kv is None and again.abort == ("p1",)


# --first-token with-decode: the handoff in the time to first token, not a gap after the first token


def test_with_decode_the_first_token_goes_out_with_the_decode_workers_first():
    workers = pool("p1", "d1")
    j, handoff = handed_off(workers, r=rules(hold_first_token=True))
    assert isinstance(handoff, DecodeOn) and handoff.emit == () and handoff.route_reason is RouteReason.DISAGGREGATED
    greq = j.worker_request(decode=True)
    assert (greq.generated_token_ids, greq.emitted_chars) == ([7], 1), "the decode worker continues after it"
    started, first, last = feed(j, "d1", start(5), token(8, "B"), finish(FinishReason.LENGTH))
    assert started.emit == ()
    assert first.emit == (Started(5), Tokens([7], "A"), Tokens([8], "B", offset=1))
    assert last.emit == (Finished("length", 5, 2),) and j.done and not j.held


def test_with_decode_a_resume_keeps_the_first_token_and_sends_it_first():
    workers = pool("p1", "d1", "d2")
    j, _ = handed_off(workers, r=rules(hold_first_token=True))
    (resume,) = feed(j, "d1", died(), workers=workers)
    assert isinstance(resume, DecodeOn) and resume.why is Why.RESUME and resume.emit == ()
    assert j.worker_request(decode=True).generated_token_ids == [7]
    (first,) = feed(j, "d2", token(8, "B"))
    assert first.emit == (Started(5), Tokens([7], "A"), Tokens([8], "B", offset=1))


def test_with_decode_a_request_that_fails_before_decode_answers_sends_nothing():
    workers = pool("p1", "d1")
    j, _ = handed_off(workers, r=rules(hold_first_token=True))
    (failed,) = feed(j, "d1", died(), workers=workers)
    assert isinstance(failed, EndWithError) and failed.emit == () and not j.held


def test_with_decode_a_worker_dying_after_the_last_token_still_sends_the_first():
    workers = pool("p1", "d1", "d2")
    j, _ = handed_off(workers, request(max_tokens=1), rules(hold_first_token=True))
    (done,) = feed(j, "d1", died(), workers=workers)
    assert isinstance(done, Finish) and done.emit == (Started(5), Tokens([7], "A"), Finished("length", 5, 1))
