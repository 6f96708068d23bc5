"""vLLM's streamed /v1/completions chunks as the router's StreamEvents, pure.

`DecodeStream` reads one chunk (a `data:` line's JSON) at a time: START before the first, TOKEN for
new tokens (ids from `return_token_ids`, each token's logprobs named by id and given the text
Tandem's workers give it), FINISH at the finish reason, ERROR for an error chunk. What the client
already has (vllm_request.DecodeCall) never goes out again: tokens vLLM regenerates are dropped, each
checked to be the one the client has (`TokenMismatch` otherwise), with the characters of text the
client has of them; text of replayed tokens the client never got (a stop string or a partial
character the dead worker held back) goes out first, and the prompt's text vLLM echoes when a
resumed prompt ends inside a character does not go out at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tandem.contracts.protocol import EventType, FinishReason, StreamEvent
from tandem.contracts.sampling import LOGPROB_FLOOR, TokenLogprobs
from tandem.router.runtimes.vllm_request import DecodeCall

TOKEN_ID_PREFIX = "token_id:"  # how vLLM names a token with return_tokens_as_token_ids
REPLACEMENT = "\ufffd"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
           "error": FinishReason.ERROR}


class TokenMismatch(ValueError):
    """vLLM regenerated a token other than the one the client already has."""


def token_id(name: str) -> int:
    if not name.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"a logprobs token {name[:40]!r} not named by id (return_tokens_as_token_ids)")
    return int(name[len(TOKEN_ID_PREFIX):])


def logprobs_wire(lp: dict[str, Any] | None, count: int, top_k: int, text: Callable[[int], str]
                  ) -> list[dict[str, Any]]:
    """vLLM's completion logprobs object (tokens by id) as TokenLogprobs.to_wire entries, one per token."""
    if not lp:
        return []
    tokens, values, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    if len(tokens) != count:
        raise ValueError(f"{len(tokens)} logprobs for {count} tokens")
    out = []
    for i, name in enumerate(tokens):
        alts = sorted(((token_id(k), v) for k, v in (tops[i] if i < len(tops) and tops[i] else {}).items()),
                      key=lambda kv: -kv[1])[:top_k]
        value = values[i] if i < len(values) and values[i] is not None else LOGPROB_FLOOR
        out.append(TokenLogprobs(token_id(name), value, alts).to_wire(text))
    return out


def unsent_text(decode: Callable[[list[int]], str], prompt: Sequence[int], replayed: Sequence[int],
                emitted_chars: int | None, context: int = 8) -> str:
    """The text of `replayed` (decoded after the prompt's last tokens, as a streaming detokenizer
    does) past what the client has; a trailing partial character stays for vLLM to complete."""
    if not replayed or emitted_chars is None:
        return ""
    tail = list(prompt[-context:])
    base, full = decode(tail), decode(tail + list(replayed))
    if not full.startswith(base):
        return ""
    return full[len(base):][emitted_chars:].rstrip(REPLACEMENT)


def prompt_echo(decode: Callable[[list[int]], str], prompt: Sequence[int], replayed: Sequence[int]) -> str:
    """The prompt's text vLLM sends back in its first text of a resume whose prompt (the client's
    prompt and the replayed tokens) ends inside a character: its detokenizer, primed with a prompt it
    cannot decode to the end, starts from the prompt's first token. "" when the prompt ends cleanly."""
    if not replayed:
        return ""
    text = decode([*prompt, *replayed])
    return text.rstrip(REPLACEMENT) if text.endswith(REPLACEMENT) else ""


class DecodeStream:
    """One decode call's stream, chunk by chunk."""

    def __init__(self, call: DecodeCall, text: Callable[[int], str], top_k: int | None, unsent: str = "",
                 echo: str = "") -> None:
        self.skip = list(call.skip_tokens)
        self.skip_chars = call.skip_chars
        self.prompt_tokens = call.prompt_tokens
        self.text, self.top_k = text, top_k
        self.unsent = unsent
        self.echo = echo  # prompt_echo: dropped from the first text when vLLM sends it
        self.started = False
        self.tokens = len(call.replayed)  # completion tokens so far, what the client has included
        self.finished = False

    def chunk(self, data: dict[str, Any]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not self.started:
            self.started = True
            events.append(StreamEvent(EventType.START, prompt_tokens=self.prompt_tokens))
        if isinstance(data.get("error"), dict):
            return [*events, self._error(data["error"])]
        for choice in data.get("choices") or []:
            if choice.get("index", 0) == 0:
                events.extend(self._choice(choice))
        return events

    def _choice(self, c: dict[str, Any]) -> list[StreamEvent]:
        ids = list(c.get("token_ids") or [])
        text = c.get("text") or ""
        lps = logprobs_wire(c.get("logprobs"), len(ids), self.top_k or 0, self.text) if self.top_k is not None else []
        self.tokens += len(ids)
        n = 0
        while self.skip and n < len(ids):
            expected = self.skip.pop(0)
            if ids[n] != expected:
                raise TokenMismatch(f"vLLM generated token {ids[n]} where the client already has {expected}")
            n += 1
        if n:
            ids, lps = ids[n:], lps[n:]
            if self.skip_chars is None and not ids:
                text = ""
        if self.echo and text:
            text, self.echo = text.removeprefix(self.echo), ""
        if self.skip_chars:
            drop = min(self.skip_chars, len(text))
            text, self.skip_chars = text[drop:], self.skip_chars - drop
        if self.unsent and (ids or text):
            text, self.unsent = self.unsent + text, ""
        events = [StreamEvent(EventType.TOKEN, token_ids=ids, text=text, logprobs=lps)] if ids or text else []
        reason = c.get("finish_reason")
        if reason is not None:
            if self.skip:
                raise TokenMismatch(f"vLLM finished ({reason}) before regenerating the {len(self.skip)} tokens "
                                    "the client already has")
            self.finished = True
            usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens}
            events.append(StreamEvent(EventType.FINISH, finish_reason=_FINISH.get(reason, FinishReason.STOP),
                                      usage=usage))
        return events

    @staticmethod
    def _error(err: dict[str, Any]) -> StreamEvent:
        code = err.get("code")
        client = isinstance(code, int) and 400 <= code < 500
        return StreamEvent(EventType.ERROR, error={
            "message": str(err.get("message", "vLLM reported an error")),
            "type": "invalid_request_error" if client else "server_error", "param": err.get("param"),
            "code": None if isinstance(code, int) else code})
