"""The exact OpenAI wire shapes: SSE frames, chunks, the usage chunk, full responses."""

from __future__ import annotations

import json

from tandem.router.sse import DONE, ResponseShape, frame
from tandem.router.validation import Endpoint


def _parse(b: bytes) -> dict:
    assert b.startswith(b"data: ") and b.endswith(b"\n\n") and b.count(b"\n\n") == 1
    return json.loads(b[len(b"data: "):])


def test_frame_is_one_data_line_and_a_blank_line():
    assert _parse(frame({"a": "x\ny"})) == {"a": "x\ny"}
    assert DONE == b"data: [DONE]\n\n"


def test_chat_chunks():
    shape = ResponseShape(Endpoint.CHAT, "r1", "m", 123)
    first = shape.chunk("", role=True)
    assert first["id"] == "chatcmpl-r1" and first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first
    last = shape.chunk(None, "stop")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"


def test_usage_chunk_only_when_asked_and_null_usage_before_it():
    shape = ResponseShape(Endpoint.COMPLETION, "r2", "m", 1, include_usage=True)
    c = shape.chunk("hi")
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "hi" and c["usage"] is None
    u = shape.usage_chunk(5, 3)
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_full_responses():
    chat = ResponseShape(Endpoint.CHAT, "r", "m", 1).full([("hello", "length", None)], 4, 2)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["total_tokens"] == 6
    comp = ResponseShape(Endpoint.COMPLETION, "r", "m", 1).full([("x", "stop", None)], 1, 1)
    assert comp["id"] == "cmpl-r" and comp["choices"][0]["text"] == "x"
