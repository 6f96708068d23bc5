"""A worker that takes a request over (a handoff, a resume after a failure) replays the tokens so far
through its detokenizer and resumes at the text the client has: the client then gets exactly the
text of an undisturbed run, whatever the previous worker held back when it stopped.

A byte-level tokenizer (one token per UTF-8 byte) lets each test cut at every point, including
inside a character and inside a possible stop string.
"""

from __future__ import annotations

import pytest
from tandem.worker.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = one UTF-8 byte; decodes like a Hugging Face tokenizer (U+FFFD for a cut character)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


TOK = ByteTokenizer()
PROMPT = list(b"Q: ")


def tokens(text: str) -> list[int]:
    return list(text.encode())


def generate(d: IncrementalDetokenizer, ids: list[int], done: bool) -> tuple[str, bool]:
    """What a worker streams for ids: add then take per token, final on a stop or (if done) at the end."""
    out = []
    for i, t in enumerate(ids):
        stopped = d.add(t)
        out.append(d.take(final=stopped or (done and i == len(ids) - 1)))
        if stopped:
            return "".join(out), True
    return "".join(out), False


def resumed_run(ids: list[int], k: int, stop: list[str]) -> str:
    """The client's text when the worker that streamed ids[:k] dies and another takes over."""
    first = IncrementalDetokenizer(TOK, PROMPT, stop)
    sent, stopped = generate(first, ids[:k], done=k == len(ids))
    if stopped:
        return sent
    second = IncrementalDetokenizer(TOK, PROMPT, stop)
    for t in ids[:k]:  # replay, as Engine.make_sequence does
        second.add(t)
        second.take()
    second.resume_at(len(sent))
    rest, _ = generate(second, ids[k:], done=True)
    return sent + rest


def undisturbed(ids: list[int], stop: list[str]) -> str:
    return generate(IncrementalDetokenizer(TOK, PROMPT, stop), ids, done=True)[0]


CASES = {
    # "STOP" spans the resume point at several cuts: it must still stop
    "stop string spanning the resume point": ("hello STOP world", ["STOP"], "hello "),
    # multi-byte characters cut between two tokens at many cuts
    "partial UTF-8 at the resume point": ("Café 東京 🚀 done", [], "Café 東京 🚀 done"),
    # "STO" is held back as a possible stop, then turns out not to be one
    "held-back stop prefix that is not a stop": ("ab STOX cd", ["STOP"], "ab STOX cd"),
    # a stop string made of multi-byte characters
    "stop string of multi-byte characters": ("naïve 東京 café", ["東京"], "naïve "),
}


@pytest.mark.parametrize("case", CASES)
def test_resuming_anywhere_gives_the_undisturbed_text(case):
    text, stop, want = CASES[case]
    ids = tokens(text)
    assert undisturbed(ids, stop) == want
    for k in range(len(ids) + 1):
        assert resumed_run(ids, k, stop) == want, f"resumed after {k} tokens"


def test_the_dead_worker_really_held_text_back_at_those_points():
    """The cases above cut where text is held back (else they would prove nothing)."""
    d = IncrementalDetokenizer(TOK, PROMPT, ["STOP"])
    sent, _ = generate(d, tokens("hello STO"), done=False)
    assert sent == "hello " and d.text == "hello STO"
    d = IncrementalDetokenizer(TOK, PROMPT)
    sent, _ = generate(d, tokens("Caf") + tokens("é")[:1], done=False)
    assert sent == "Caf"


def test_resume_at_refuses_more_text_than_the_tokens_make():
    d = IncrementalDetokenizer(TOK, PROMPT)
    for t in tokens("abc"):
        d.add(t)
    with pytest.raises(ValueError, match="3 characters long"):
        d.resume_at(4)
    with pytest.raises(ValueError):
        d.resume_at(-1)
    d.resume_at(1)
    assert d.take(final=True) == "bc"
