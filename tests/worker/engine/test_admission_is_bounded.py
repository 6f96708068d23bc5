"""What the engine admits: ids unique across running, queued, leased and being-pulled requests; a
queue bounded beyond the free seats (429 with a retry hint); pulled sequences waiting for a seat
(max_num_seqs holds for them) and decoding in the step that seats them; a queued request that can
be withdrawn until it starts; block reservations for a pull made under the engine's lock, leaving
room for the running sequences' next tokens."""

from __future__ import annotations

import pytest
from tandem.contracts.protocol import GenerateRequest
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of
from tandem.worker.engine.errors import RequestError

IDS = [0] + list(range(5, 25))  # 21 tokens


def _refused(fn, status: int, code: str) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn()
    assert (e.value.status, e.value.code) == (status, code)
    return e.value


def test_the_queue_is_bounded_beyond_the_free_seats(make_engine):
    eng = make_engine(max_num_seqs=2, max_waiting=1)
    outs = [submit(eng, f"r{i}", IDS, greedy(3)) for i in range(3)]  # 2 seats + 1 waiting
    err = _refused(lambda: submit(eng, "r3", IDS, greedy(3)), 429, "queue_full")
    assert err.retry_after_s is not None and err.type == "service_unavailable"
    _refused(lambda: eng.claim("h"), 429, "queue_full")  # a handoff's place too
    run_to_completion(eng)
    assert all(len(tokens_of(o)) == 3 for o in outs)
    submit(eng, "r3", IDS, greedy(3))  # room again
    run_to_completion(eng)


def test_ids_are_unique_across_queued_leased_and_claimed(make_engine):
    eng = make_engine()
    submit(eng, "q", IDS, greedy(3))
    eng.claim("c")
    prefill = eng.make_sequence(GenerateRequest(request_id="l", prompt_token_ids=IDS, sampling=greedy(4)),
                                prefill_only=True)
    eng.add(prefill)
    run_to_completion(eng)  # "q" finished; "l" leased
    assert "l" in eng.leases
    _refused(lambda: submit(eng, "l", IDS, greedy(3)), 409, "duplicate_request_id")
    for rid in ("c", "l"):  # a claim or a lease holds its id; a submit takes over its own claim
        _refused(lambda rid=rid: eng.claim(rid), 409, "duplicate_request_id")
    eng.claim("q")  # "q" finished: its id is free
    eng.unclaim("q")
    eng.unclaim("c")
    eng.abort("l", eng.lease_token("l"))
    submit(eng, "l", IDS, greedy(2))  # every id is free again
    run_to_completion(eng)


def test_pulled_sequences_wait_for_a_seat_and_decode_when_seated(make_engine, reference):
    eng = make_engine(max_num_seqs=2)
    first = reference(IDS, 1)[0]
    pulled = []
    for i in range(4):
        seq = eng.make_sequence(GenerateRequest(request_id=f"p{i}", prompt_token_ids=IDS, sampling=greedy(6),
                                                generated_token_ids=[first]))
        outs: list = []
        seq.sink = outs.append
        eng.claim(seq.request_id)
        assert eng.begin_pull(seq) is not None and eng.seqs[seq.request_id].status == "pulling"
        eng.finish_pull(seq)  # as after a pull into the blocks it reserved
        pulled.append(outs)
    assert eng.num_running == 0 and eng.num_waiting == 4
    chunks = eng.scheduler.schedule()
    assert [c.seq.request_id for c in chunks] == ["p0", "p1"]  # seated, and decoding in this very step
    assert all((c.start, c.num_tokens, c.sample) == (len(IDS), 1, True) for c in chunks)
    assert eng.num_running == 2 and eng.num_waiting == 2
    for i in range(4):
        eng.abort(f"p{i}")
    assert eng.allocator.num_used == 0 and all(o[-1].finish_reason == "abort" for o in pulled)


def test_a_queued_request_can_be_withdrawn_until_it_runs(make_engine):
    eng = make_engine(max_num_seqs=1)
    submit(eng, "runs", IDS, greedy(4))
    submit(eng, "waits", IDS, greedy(4))
    eng.step()
    assert not eng.withdraw("runs")
    assert eng.withdraw("waits") and "waits" not in eng.seqs
    assert not eng.withdraw("waits")
    run_to_completion(eng)


def test_reservations_take_the_engine_lock_and_leave_room_for_running_sequences(make_engine):
    eng = make_engine(num_blocks=8, block_size=16)
    submit(eng, "a", IDS, greedy(30))
    submit(eng, "b", IDS, greedy(30))
    eng.step()  # two running sequences hold 2 blocks each
    assert eng.allocator.num_free == 4

    def handoff(rid: str, num_tokens: int):  # a prompt sharing no block with IDS
        return eng.make_sequence(GenerateRequest(request_id=rid, prompt_token_ids=[0] + list(range(30, 29 + num_tokens)),
                                                 sampling=greedy(4), generated_token_ids=[7]))

    assert eng.begin_pull(handoff("big", 3 * 16)) is None  # 3 of 4 free would leave less than a block each
    held = []
    real = eng.allocator.allocate

    def allocate(n):
        held.append(eng.lock.held_here())  # the scheduler's check and this allocation cannot interleave
        return real(n)

    eng.allocator.allocate = allocate
    fits = handoff("fits", 2 * 16)
    got = eng.begin_pull(fits)
    assert held == [True] and len(got.fresh) == 2 and not got.cached
    eng.fail_pull(fits)
    run_to_completion(eng)
