"""OpenAI response bodies and server-sent-event framing, for chat and completions alike.

Pure functions, so the exact wire format the `openai` client parses is unit-tested.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.router.validation import Endpoint

DONE = b"data: [DONE]\n\n"


def frame(payload: dict[str, Any]) -> bytes:
    """One SSE event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _chat_entry(e: dict[str, Any]) -> dict[str, Any]:
    token = e["token"]
    return {"token": token, "logprob": e["logprob"], "bytes": list(token.encode("utf-8", "replace"))}


def logprobs_body(endpoint: Endpoint, entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object for tokens' wire entries (TokenLogprobs.to_wire): chat's `content`
    list, or completions' parallel lists (`text_offset` counts from `offset` characters)."""
    if endpoint is Endpoint.CHAT:
        return {"content": [_chat_entry(e) | {"top_logprobs": [_chat_entry(t) for t in e["top"]]}
                            for e in entries]}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries],
            "text_offset": offsets}


@dataclass
class ResponseShape:
    """What every body of one response shares: id, creation time, model and endpoint."""

    endpoint: Endpoint
    request_id: str
    model: str
    created: int
    include_usage: bool = False

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.endpoint is Endpoint.CHAT else "cmpl-") + self.request_id

    def _base(self, chunk: bool) -> dict[str, Any]:
        if self.endpoint is Endpoint.CHAT:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(
        self, text: str | None, finish_reason: str | None = None, role: bool = False,
        logprobs: dict[str, Any] | None = None, index: int = 0, tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A streamed delta; `role` marks the chat stream's first chunk; `logprobs` (logprobs_body)
        those of the delta's tokens."""
        if self.endpoint is Endpoint.CHAT:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        body = self._base(chunk=True) | {"choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, only usage."""
        return self._base(chunk=True) | {
            "choices": [],
            "usage": usage_dict(prompt_tokens, completion_tokens),
        }

    def full(
        self, choices: list[tuple[str | dict[str, Any], str, dict[str, Any] | None]], prompt_tokens: int,
        completion_tokens: int,
    ) -> dict[str, Any]:
        """The whole non-streaming response: (text or chat message, finish reason, logprobs body) per choice."""
        out = []
        for i, (text, finish_reason, logprobs) in enumerate(choices):
            if self.endpoint is Endpoint.CHAT:
                message = text if isinstance(text, dict) else {"role": "assistant", "content": text}
                out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
            else:
                out.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
        return self._base(chunk=False) | {"choices": out, "usage": usage_dict(prompt_tokens, completion_tokens)}
