"""Incremental detokenization with stop strings: text deltas that never split a UTF-8 character
and never emit text a stop string could still swallow.

It is a deterministic state machine over (prompt, generated tokens, stop strings), so a worker that
takes over a request (a decode worker after the prefill worker's first token, another decode worker
after a failure) replays the tokens generated so far, calling add() then take() for each exactly as
their producer did, and then `resume_at` the text the client already has: it holds back and emits
exactly what an undisturbed run would have.
"""

from __future__ import annotations

from typing import Any

# How many context tokens to decode before the new ones, so tokenizers that drop a leading space
# at the start of a decode (SentencePiece) still produce the right delta.
_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, context_ids: list[int], stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.ids = list(context_ids)
        self.prefix_offset = max(len(self.ids) - _CONTEXT, 0)
        self.read_offset = len(self.ids)
        self.stop = [s for s in (stop or []) if s]
        self.text = ""  # generated text so far (truncated at a stop string)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> bool:
        """Append a generated token; True when a stop string has now appeared (text is cut before it)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # a partial UTF-8 sequence (or nothing visible yet): wait for more tokens
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(0, old_len - longest + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return self.stopped

    def _holdback(self) -> int:
        """Characters at the end of the text that could be the start of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def resume_at(self, chars: int) -> None:
        """The client already has the first `chars` characters of the text (another worker sent
        them): hand out only what follows. Raises ValueError when the text is not that long."""
        if isinstance(chars, bool) or not isinstance(chars, int) or not 0 <= chars <= len(self.text):
            raise ValueError(f"the client cannot have {chars!r} characters of a text that is "
                             f"{len(self.text)} characters long after these tokens")
        self.emitted = chars

    def take(self, final: bool = False) -> str:
        """The text not handed out yet; all of it when final, else minus a possible stop-string prefix."""
        if final and not self.stopped and self.read_offset < len(self.ids):
            # Finished on a partial UTF-8 character: hand out what the tokenizer makes of it.
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._holdback()
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
