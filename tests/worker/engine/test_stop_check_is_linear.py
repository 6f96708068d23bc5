"""The stop check and the text it holds back cost work proportional to the new text, whatever the
stop strings' length, and the text decoded per token stays bounded however long the output.
Work is counted (automaton steps, token ids handed to the tokenizer), never timed."""

from __future__ import annotations

from tandem.worker.engine.detokenizer import IncrementalDetokenizer
from tandem.worker.engine.stop_strings import StopMatcher


class CountingByteTokenizer:
    """Token id = one UTF-8 byte; counts the ids it is asked to decode."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


PROMPT = list(b"Q: ")
# Long and self-overlapping: a naive search re-scans a window this long at every token.
STOPS = ["a" * 1000 + "b", "ab" * 400 + "c", "aaab" * 200]


def _stream(n: int, text: bytes, stops: list[str]) -> tuple[IncrementalDetokenizer, CountingByteTokenizer, str]:
    tok = CountingByteTokenizer()
    d = IncrementalDetokenizer(tok, PROMPT, stops)
    out = []
    for t in (text * n)[:n]:
        d.add(t)
        out.append(d.take())
    return d, tok, "".join(out)


def test_stop_check_work_per_character_is_constant():
    works = {}
    for n in (500, 2000, 8000):
        d, tok, sent = _stream(n, b"a", STOPS)
        assert not d.stopped and d.length == n
        assert sent == "a" * (n - min(n, 1000))  # the last 1000 "a" may still become the first stop
        works[n] = d.work
        assert d.work <= 2 * n, f"{d.work} automaton steps for {n} characters"
        assert tok.decoded <= 20 * n
    assert works[8000] - works[2000] <= 2 * (8000 - 2000)  # each further character: at most 2 steps


def test_stop_found_in_the_middle_of_long_text_is_cut_exactly():
    text = "x" * 5000 + "ab" * 400 + "c" + "tail"
    d, tok, sent = _stream(len(text), text.encode(), STOPS)
    assert d.stopped and d.text == "x" * 5000
    assert sent + d.take(final=True) == "x" * 5000
    assert d.work <= 2 * len(text)


def test_decoding_stays_bounded_when_bytes_never_form_a_character():
    n = 3000
    d, tok, sent = _stream(n, b"\xff", [])  # a model emitting stray bytes, forever
    assert tok.decoded <= 40 * n  # a window that grew with the output would decode ~n*n/2 ids
    assert set(sent + d.take(final=True)) == {"\ufffd"}


def test_matcher_building_is_linear_in_the_stop_strings():
    m = StopMatcher(["ab" * 500, "b" * 1000, "x"])
    assert len(m._goto) <= 2001 + 1
    assert m.feed("zz" + "ab" * 499 + "a") is None and m.holdback == 999
    assert m.feed("b") == (1, 1000)
