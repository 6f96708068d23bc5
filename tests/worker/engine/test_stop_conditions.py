"""Stop strings (text cut before them, never streamed), stop token ids, max tokens, the context
length; and text deltas that never split a UTF-8 character."""

from __future__ import annotations

from tandem.contracts.protocol import FinishReason
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, text_of, tokens_of
from tandem.worker.engine.detokenizer import IncrementalDetokenizer

PROMPT = "The quick brown fox jumps over"


def _greedy_text(eng, ids, n):
    outs = submit(eng, "ref", ids, greedy(n))
    run_to_completion(eng)
    return tokens_of(outs), text_of(outs)


def test_stop_string_cuts_text_before_it(make_engine, loaded_toy):
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    _, full = _greedy_text(eng, ids, 30)
    stop = full[10:13]  # a string that first appears mid-output
    assert len(stop) == 3 and full.find(stop) >= 1
    outs = submit(eng, "s", ids, greedy(30, stop=[stop, "never-appears-zz"]))
    run_to_completion(eng)
    assert outs[-1].finish_reason == FinishReason.STOP
    assert text_of(outs) == full[: full.find(stop)]
    assert stop not in text_of(outs)


def test_stop_token_id_ends_without_its_text(make_engine, loaded_toy):
    eng = make_engine()
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    toks, _ = _greedy_text(eng, ids, 20)
    stop_tok = toks[6]
    first = toks.index(stop_tok)
    outs = submit(eng, "t", ids, greedy(20, stop_token_ids=[stop_tok]))
    run_to_completion(eng)
    assert tokens_of(outs) == toks[: first + 1]
    assert outs[-1].finish_reason == FinishReason.STOP
    assert text_of(outs) == loaded_toy.tokenizer.decode(toks[:first], skip_special_tokens=True)


def test_max_tokens_and_context_length(make_engine, loaded_toy):
    ids = loaded_toy.tokenizer(PROMPT)["input_ids"]
    eng = make_engine()
    outs = submit(eng, "m", ids, greedy(5))
    run_to_completion(eng)
    assert len(tokens_of(outs)) == 5 and outs[-1].finish_reason == FinishReason.LENGTH
    short = make_engine(max_model_len=len(ids) + 3)
    outs = submit(short, "c", ids, greedy(50))
    run_to_completion(short)
    assert len(tokens_of(outs)) == 3 and outs[-1].finish_reason == FinishReason.LENGTH


def test_text_deltas_never_split_a_utf8_character(loaded_toy):
    tok = loaded_toy.tokenizer
    text = "Café 東京 こんにちは 🚀 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    d = IncrementalDetokenizer(tok, tok("Say:")["input_ids"])
    deltas = []
    for t in ids:
        d.add(t)
        deltas.append(d.take())
    deltas.append(d.take(final=True))
    assert "".join(deltas) == text
    assert not any("\ufffd" in x for x in deltas)


def test_stop_string_prefix_is_held_back_until_decided(loaded_toy):
    tok = loaded_toy.tokenizer
    d = IncrementalDetokenizer(tok, tok("x")["input_ids"], stop=["STOP"])
    out = []
    for t in tok("ab STO", add_special_tokens=False)["input_ids"]:
        d.add(t)
        out.append(d.take())
    assert "".join(out) == "ab "  # "STO" might still become "STOP"
    for t in tok("Xc", add_special_tokens=False)["input_ids"]:
        d.add(t)
        out.append(d.take())
    assert "".join(out) + d.take(final=True) == "ab STOXc"
