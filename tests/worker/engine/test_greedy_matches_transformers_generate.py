"""The engine's greedy output equals transformers' generate token for token, alone and in a batch
whose sequences have different prompt lengths and join the running batch at different steps."""

from __future__ import annotations

from tandem.contracts.protocol import FinishReason
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, text_of, tokens_of

PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog while the cat sleeps",
    "a",
    "Once upon a time there was a little model that wanted to speak every language. "
    "Prefill reads the whole prompt at once; decode writes one token at a time.",
    "Café, naïve, 東京 🚀",
]


def test_single_request_matches_generate(make_engine, loaded_toy, reference):
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPTS[1])["input_ids"]
    outs = submit(eng, "r0", ids, greedy(24))
    run_to_completion(eng)
    assert tokens_of(outs) == reference(ids, 24)
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
    # The streamed text deltas add up to the detokenized output.
    assert text_of(outs) == loaded_toy.tokenizer.decode(tokens_of(outs), skip_special_tokens=True)


def test_batch_joining_at_different_steps_matches_generate(make_engine, loaded_toy, reference):
    eng = make_engine(block_size=4)  # small blocks: sequences span many non-adjacent blocks
    tok = loaded_toy.tokenizer
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    lengths = [20, 13, 17, 9, 22]
    outs = {}
    # Sequences join while the others are mid-decode: 0 at step 0, 1 at step 3, 2 and 3 at step 5, 4 at step 11.
    joins = {0: [0], 3: [1], 5: [2, 3], 11: [4]}
    step = 0
    while step == 0 or eng.has_work() or any(s > step for s in joins):
        for i in joins.get(step, []):
            outs[i] = submit(eng, f"r{i}", prompt_ids[i], greedy(lengths[i]))
        eng.step()
        step += 1
    for i, ids in enumerate(prompt_ids):
        assert tokens_of(outs[i]) == reference(ids, lengths[i]), f"sequence {i} diverged"


def test_eos_ends_generation_like_generate(make_engine, loaded_toy, reference):
    """Without ignore_eos, generation stops at EOS (included in the token ids), as generate does."""
    eng = make_engine()
    ids = loaded_toy.tokenizer("She sells sea shells")["input_ids"]
    ref = reference(ids, 40, ignore_eos=False)
    assert ref[-1] in loaded_toy.eos_ids and len(ref) < 40, "precondition: the toy model emits EOS here"
    outs = submit(eng, "eos", ids, greedy(40, ignore_eos=False))
    run_to_completion(eng)
    assert tokens_of(outs) == ref
    assert outs[-1].finish_reason == FinishReason.STOP
