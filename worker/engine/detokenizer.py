"""Incremental detokenization with stop strings: text deltas that never split a UTF-8 character
and never emit text a stop string could still swallow.

It is a deterministic state machine over (prompt, generated tokens, stop strings), so a worker that
takes over a request (a decode worker after the prefill worker's first token, another decode worker
after a failure) replays the tokens generated so far, calling add() then take() for each exactly as
their producer did, and then `resume_at` the text the client already has: it holds back and emits
exactly what an undisturbed run would have.

Each token costs work proportional to its own text: a few tokens are decoded around it (never a
window that grows with the output), the stop check runs an automaton over the new characters
(stop_strings.py), and the text is kept in pieces rather than copied whole at every token.
"""

from __future__ import annotations

from typing import Any

from tandem.worker.engine.stop_strings import StopMatcher

# How many context tokens to decode before the new ones, so tokenizers that drop a leading space
# at the start of a decode (SentencePiece) still produce the right delta.
_CONTEXT = 5
# Tokens that may wait for a UTF-8 character to complete (or for visible text) before what the
# tokenizer makes of them is taken as it is: a character is at most 4 bytes, so only a model
# emitting stray bytes or invisible tokens reaches it, and the decode window stays bounded.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, context_ids: list[int], stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.ids = list(context_ids)
        self.prefix_offset = max(len(self.ids) - _CONTEXT, 0)
        self.read_offset = len(self.ids)
        self.stop = [s for s in (stop or []) if s]
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self._parts: list[str] = []  # the generated text (truncated at a stop string), in pieces
        self.length = 0  # characters of generated text
        self.emitted = 0  # characters of it already handed out
        self._unsent = ""  # text[emitted:]
        self.stopped = False

    @property
    def text(self) -> str:
        """The generated text so far (cut before a stop string)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def work(self) -> int:
        """Steps the stop check took so far (its cost, which tests count)."""
        return self._matcher.work if self._matcher is not None else 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _delta(self) -> str:
        """The text the tokens after read_offset add; the offsets move past them."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def add(self, token_id: int) -> bool:
        """Append a generated token; True when a stop string has now appeared (text is cut before it).
        After that the text is final: further tokens add nothing."""
        if self.stopped:
            return True
        self.ids.append(token_id)
        if len(self.ids) - self.read_offset < _MAX_PENDING:
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return False  # a partial UTF-8 sequence (or nothing visible yet): wait for more tokens
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        else:
            new = self._delta()
        self._append(new, check=True)
        return self.stopped

    def _append(self, new: str, check: bool) -> None:
        hit = self._matcher.feed(new) if check and self._matcher is not None else None
        if hit is not None:
            end, n = hit
            self.stopped = True
            if end >= n:  # the stop string lies inside the new text
                new = new[: end - n]
            else:  # it began in text held back before: cut there
                self._cut(self.length - (n - end))
                new = ""
        if new:
            self._parts.append(new)
            self.length += len(new)
            self._unsent += new

    def _cut(self, at: int) -> None:
        text = self.text[:at]
        self._parts, self.length = [text], at
        self._unsent = text[self.emitted :]

    def resume_at(self, chars: int) -> None:
        """The client already has the first `chars` characters of the text (another worker sent
        them): hand out only what follows. Raises ValueError when the text is not that long."""
        if isinstance(chars, bool) or not isinstance(chars, int) or not 0 <= chars <= self.length:
            raise ValueError(f"the client cannot have {chars!r} characters of a text that is "
                             f"{self.length} characters long after these tokens")
        self.emitted = chars
        self._unsent = self.text[chars:]

    def take(self, final: bool = False) -> str:
        """The text not handed out yet; all of it when final, else minus a possible stop-string prefix."""
        if final and not self.stopped and self.read_offset < len(self.ids):
            # Finished on a partial UTF-8 character: hand out what the tokenizer makes of it.
            self._append(self._delta(), check=False)
        holdback = 0 if (final or self.stopped or self._matcher is None) else self._matcher.holdback
        end = self.length - holdback
        if end <= self.emitted:
            return ""
        delta, self._unsent = self._unsent[: end - self.emitted], self._unsent[end - self.emitted :]
        self.emitted = end
        return delta
