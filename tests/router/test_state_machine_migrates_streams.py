"""The MIGRATE transition as a pure decision: a decode worker that leaves hands the stream to another
decode worker of its kv_compat with its KV lease, the client's events run on without a gap in
tokens or text, and it is a migration (timed to the next token), not a failure; without usable
KV (none, another kv_compat, a token list that disagrees, a pull that fails) the stream is
recomputed and the lease freed; with no worker left it is a 502 and the lease is freed. The
driver's side (metrics, aborts on the wire) is in test_request_driver.py."""

from __future__ import annotations

import pytest
from tandem.contracts.protocol import FinishReason
from tandem.router.actions import Abort, DecodeOn, EndWithError, Finish, Moved, Read, Why
from tandem.router.decide import decide
from tandem.router.journey import Finished, Tokens
from tandem.router.outcomes import Aborted
from tandem.router.policies.base import Snapshot
from tandem.testing.fake_workers import fail, finish, migrate, start, token
from tandem.testing.journeys import feed, handed_off, pool


def leaving(*decode: str, with_kv: bool = True, listed: list[int] | None = None):
    """A journey on d1 that has streamed A, B, C when d1 sends MIGRATE at time 10 (KV of 7 tokens)."""
    workers = pool("p1", *decode)
    j, _ = handed_off(workers)
    feed(j, "d1", start(5), token(8, "B"), token(9, "C"))
    line = migrate("d1", [7, 8, 9] if listed is None else listed, 7, with_kv=with_kv)
    (action,) = feed(j, "d1", line, workers=workers, now=10.0)
    return j, action, workers


def test_migrate_moves_the_stream_and_its_kv_to_another_decode_worker():
    j, move, workers = leaving("d1", "d2")
    assert isinstance(move, DecodeOn) and move.why is Why.MIGRATE and move.worker.url == "d2"
    assert move.abort == () and move.blame is None, "not a failure: the pull frees the lease"
    req = j.worker_request(decode=True)
    assert req.kv_source is not None and req.kv_source.url == "d1" and req.kv_source.num_tokens == 7
    assert req.generated_token_ids == [7, 8, 9] and req.emitted_chars == 3 and req.migrated_from == "d1"
    assert j.lease_tokens["d1"] == "token-of-d1", "an abort while it moves frees the lease by its token"
    first, more, done = feed(j, "d2", token(10, "D"), token(11, "E"), finish(FinishReason.LENGTH), now=10.25)
    assert first.moved == Moved("d1", "kv", 0.25) and more.moved is None, "timed to the next worker's first token"
    assert isinstance(done, Finish) and done.emit == (Finished("length", 5, 5),) and j.move is None
    assert j.failures == 0 and "d1" in j.excluded


def test_failed_pull_falls_back_to_recompute_and_frees_the_lease():
    j, move, workers = leaving("d1", "d2")
    (abort,) = feed(j, "d2", fail(503, "kv_transfer_failed", type_="service_unavailable"), workers=workers)
    assert isinstance(abort, Abort) and abort.url == "d2"
    recompute = decide(j, Aborted("d2"), Snapshot(workers))
    assert isinstance(recompute, DecodeOn) and recompute.worker.url == "d2" and recompute.abort == ("d1",)
    req = j.worker_request(decode=True)
    assert req.kv_source is None and req.generated_token_ids == [7, 8, 9] and req.emitted_chars == 3
    assert j.lease_tokens["d1"] == "token-of-d1", "the lease is freed by its token"
    (first,) = feed(j, "d2", token(10, "D"), now=11.0)
    assert first.moved == Moved("d1", "recompute", 1.0)


@pytest.mark.parametrize("case", ["no_kv", "other_kv_compat", "tokens_disagree"])
def test_without_usable_kv_the_stream_is_recomputed(case):
    if case == "no_kv":
        j, move, _ = leaving("d1", "d2", with_kv=False)
    elif case == "other_kv_compat":  # KV of one kv_compat's model must never reach another's
        j, move, _ = leaving("d1", "d2@g2")
    else:
        j, move, _ = leaving("d1", "d2", listed=[7, 8])
    assert isinstance(move, DecodeOn) and move.worker.url == "d2" and j.kv is None
    req = j.worker_request(decode=True)
    assert req.kv_source is None and req.generated_token_ids == [7, 8, 9] and req.migrated_from is None
    if case != "no_kv":  # the lease a MIGRATE line names is freed at once when nobody will pull it
        assert move.abort == ("d1",) and j.lease_tokens["d1"] == "token-of-d1"
    (first,) = feed(j, "d2", token(10, "D"))
    assert first.moved.outcome == "recompute" and first.emit == (Tokens([10], "D", offset=3),)


def test_the_same_kv_compat_is_preferred_for_the_kv():
    j, move, _ = leaving("d1", "d2@g2", "d3")
    assert move.worker.url == "d3" and j.kv is not None and j.kv_compat == "g1"


def test_no_decode_worker_left_is_a_502_and_frees_the_lease():
    j, action, _ = leaving("d1")
    assert isinstance(action, EndWithError) and action.error.status == 502 and action.abort == ("d1",)
    assert j.touched == ["p1", "d1"], "never back to the worker that is leaving"
    assert j.move is not None, "the driver counts it as a failed migration"


def test_a_heartbeat_during_a_move_is_not_its_end():
    j, _, _ = leaving("d1", "d2")
    (beat,) = feed(j, "d2", start(5))
    assert isinstance(beat, Read) and beat.moved is None and j.move is not None
