"""Token texts for logprobs, as OpenAI reports them: each token decoded alone. Torch-free, for the
worker's HTTP layer, which adds them to the ids the engine's logprobs carry (logprobs.py).
"""

from __future__ import annotations

from typing import Any

from tandem.contracts.sampling import TokenLogprobs


class TokenTexts:
    """Each token id's text as OpenAI reports it in logprobs (the token decoded alone), cached: a
    vocabulary is finite and the same ids recur."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._cache.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
            if len(self._cache) < 1 << 20:
                self._cache[token_id] = t
        return t

    def wire(self, lps: list[TokenLogprobs] | None) -> list[dict[str, Any]]:
        """The NDJSON/JSON form of tokens' logprobs, with texts ([] for none)."""
        return [lp.to_wire(self.text) for lp in lps or ()]

    _by_tokenizer: dict[int, TokenTexts] = {}

    @classmethod
    def of(cls, tokenizer: Any) -> TokenTexts:
        """One cache per tokenizer (an engine's), made on first use."""
        texts = cls._by_tokenizer.get(id(tokenizer))
        if texts is None or texts.tokenizer is not tokenizer:
            texts = cls._by_tokenizer[id(tokenizer)] = cls(tokenizer)
        return texts
