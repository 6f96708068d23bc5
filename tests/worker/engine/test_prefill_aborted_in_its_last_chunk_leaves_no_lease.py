"""A prefill cancelled while the step that computes its last chunk is in flight leaves no lease
behind: the abort marks it ABORTING, and the step ends it instead of leasing it (issue 21, defect 3:
the lease used to wait for lease_s, and repeated it filled the pool)."""

from __future__ import annotations

from tandem.contracts.protocol import GenerateRequest
from tandem.testing.engine_helpers import greedy

PROMPT = list(range(5, 45))


def _abort_during_next_step(eng, request_id: str) -> None:
    """The caller gives up while the next forward pass runs (as an HTTP handler cancelled then does)."""
    forward = eng.runner.forward

    def forward_and_abort(items):
        assert request_id in eng.requests.in_flight, "the abort must land while the step is in flight"
        eng.abort(request_id)
        return forward(items)

    eng.runner.forward = forward_and_abort


def test_an_abort_during_the_last_chunk_ends_the_lease_that_step_made(make_engine):
    eng = make_engine(lease_s=300.0)
    seq = eng.make_sequence(GenerateRequest(request_id="p", prompt_token_ids=PROMPT, sampling=greedy(4)),
                            prefill_only=True)
    outs: list = []
    seq.sink = outs.append
    eng.add(seq)
    _abort_during_next_step(eng, "p")
    eng.step()  # the whole prompt in one chunk: its first token is sampled, and it ends unleased
    assert "p" not in eng.leases, "the lease waits for lease_s although nobody will ever get its token"
    assert eng.allocator.num_used == 0
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert eng.stats.requests_finished.get("abort") == 1


def test_an_abort_during_a_chunk_that_is_not_the_last_still_ends_the_prefill(make_engine):
    eng = make_engine(prefill_chunk_tokens=16, max_batched_tokens=16, max_num_seqs=4)
    seq = eng.make_sequence(GenerateRequest(request_id="p", prompt_token_ids=PROMPT, sampling=greedy(4)),
                            prefill_only=True)
    outs: list = []
    seq.sink = outs.append
    eng.add(seq)
    _abort_during_next_step(eng, "p")
    eng.step()  # the first of three chunks
    assert not eng.has_work() and "p" not in eng.seqs and "p" not in eng.leases
    assert eng.allocator.num_used == 0 and outs[-1].finish_reason == "abort"
