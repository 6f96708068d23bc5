"""A failure caused by one sequence ends that sequence alone; the others in its batch go on, token for
token as transformers would generate them. Poisons injected where no request can reach any more
(validation refuses them at the door, see test_sampling_params_are_checked_where_they_enter.py):
a sampling call that overflows (the issue's `temperature: 1e-300`), a forward pass that raises
whenever one sequence is in the batch, a detokenizer that raises."""

from __future__ import annotations

from tandem.contracts.protocol import FinishReason
from tandem.contracts.sampling import SamplingParams
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of

INNOCENT = "Kubernetes schedules pods onto nodes"
OTHER = "An operator reconciles what it owns"


def _batches(eng) -> list[list[str]]:
    """Record the request ids of every forward pass (wrapping the engine's runner)."""
    seen: list[list[str]] = []
    real = eng.runner.forward

    def forward(items):
        tables = [it.block_table for it in items]
        seen.append([rid for rid, s in list(eng.seqs.items()) if s.block_table in tables])
        return real(items)

    eng.runner.forward = forward
    return seen


def _failed(outs) -> dict:
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.ERROR, outs[-1]
    assert outs[-1].error["code"] == "engine_error" and outs[-1].error["type"] == "internal_error"
    return outs[-1].error


def test_a_sampling_overflow_fails_its_row_not_the_batch(make_engine, loaded_toy, reference):
    eng = make_engine()
    tok = loaded_toy.tokenizer
    ids, other = tok(INNOCENT)["input_ids"], tok(OTHER)["input_ids"]
    batches = _batches(eng)
    innocent = submit(eng, "innocent", ids, greedy(12))
    poisoned = submit(eng, "poisoned", other, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    eng.seqs["poisoned"].params.temperature = 1e-300  # logits / 1e-300: inf, then NaN probabilities
    run_to_completion(eng)
    assert sorted(batches[0]) == ["innocent", "poisoned"]  # they shared the step that failed
    assert tokens_of(innocent) == reference(ids, 12)
    assert innocent[-1].finish_reason == FinishReason.LENGTH
    assert "probability tensor" in _failed(poisoned)["message"]
    assert tokens_of(poisoned) == []
    assert eng.stats.requests_finished == {"length": 1, "error": 1}


def test_a_forward_pass_that_raises_for_one_sequence_fails_only_it(make_engine, loaded_toy, reference):
    eng = make_engine()
    tok = loaded_toy.tokenizer
    ids, other = tok(INNOCENT)["input_ids"], tok(OTHER)["input_ids"]
    real = eng.runner.forward
    sizes: list[int] = []

    def forward(items):
        sizes.append(len(items))
        bad = eng.seqs.get("bad")
        if bad is not None and len(bad.output_ids) >= 3 and any(it.block_table == bad.block_table for it in items):
            raise RuntimeError("injected: this sequence's input breaks the kernel")
        return real(items)

    eng.runner.forward = forward
    innocent = submit(eng, "innocent", ids, greedy(10))
    bad = submit(eng, "bad", other, greedy(10))
    run_to_completion(eng)
    assert tokens_of(innocent) == reference(ids, 10)
    assert len(tokens_of(bad)) == 3 and "injected" in _failed(bad)["message"]
    failing = sizes.index(2, 3)  # the 4th step, both decoding: it failed, then each half ran alone
    assert sizes[failing:failing + 3] == [2, 1, 1]


def test_a_detokenizer_that_raises_fails_only_its_sequence(make_engine, loaded_toy, reference):
    eng = make_engine()
    tok = loaded_toy.tokenizer
    ids, other = tok(INNOCENT)["input_ids"], tok(OTHER)["input_ids"]

    class Exploding:
        def __init__(self, inner, after: int):
            self.inner, self.after = inner, after

        def add(self, token_id):
            self.after -= 1
            if self.after < 0:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return self.inner.add(token_id)

        def take(self, final=False):
            return self.inner.take(final)

    innocent = submit(eng, "innocent", ids, greedy(10))
    bad = submit(eng, "bad", other, greedy(10))
    eng.seqs["bad"].detok = Exploding(eng.seqs["bad"].detok, after=4)
    run_to_completion(eng)
    assert tokens_of(innocent) == reference(ids, 10)
    assert len(tokens_of(bad)) == 4 and "injected" in _failed(bad)["message"]


def test_the_engine_serves_on_after_every_poison(make_engine, loaded_toy, reference):
    eng = make_engine()
    ids = loaded_toy.tokenizer(INNOCENT)["input_ids"]
    poisoned = submit(eng, "p", ids, SamplingParams(max_tokens=4, temperature=1.0))
    eng.seqs["p"].params.temperature = float("nan")
    run_to_completion(eng)
    _failed(poisoned)
    after = submit(eng, "after", ids, greedy(6))
    run_to_completion(eng)
    assert tokens_of(after) == reference(ids, 6)
