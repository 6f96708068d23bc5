"""One decoder for the JSON documents a request carries (a schema, a tool call's arguments, in a string
or not), shared by the router and the workers' grammar: one depth limit, a BodyError naming the
field (never a RecursionError), and what it lets through fits a worker's body wherever it travels."""

from __future__ import annotations

import json

import pytest
from tandem.contracts.json_body import (
    DOCUMENT_PREFIX_DEPTH,
    MAX_DEPTH,
    MAX_DOCUMENT_DEPTH,
    BodyError,
    NotJSONError,
    check_value,
    decode_document,
)
from tandem.contracts.structured_output import StructuredOutputError, validate


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_document_at_the_limit_fits_a_workers_body_at_its_deepest_place():
    doc = decode_document(_nested(MAX_DOCUMENT_DEPTH), "messages")
    assert DOCUMENT_PREFIX_DEPTH + MAX_DOCUMENT_DEPTH <= MAX_DEPTH
    check_value({"messages": [{"tool_calls": [{"function": {"arguments": doc}}]}]})  # the worker's own check


@pytest.mark.parametrize("text", [_nested(MAX_DOCUMENT_DEPTH + 1), _nested(200_000)])
def test_deeper_documents_are_a_400_naming_the_field(text):
    with pytest.raises(BodyError) as info:
        decode_document(text, "guided_json")
    assert (info.value.status, info.value.param) == (400, "guided_json")
    assert f"nested more than {MAX_DOCUMENT_DEPTH} levels deep" in str(info.value)


@pytest.mark.parametrize(("text", "code"), [('{"a": NaN}', "invalid_value"), ('{"a": 1e400}', "invalid_value"),
                                            ('{"a": "\\ud800"}', "invalid_value"), ("[" + "9" * 5000 + "]",
                                                                                    "invalid_value")])
def test_documents_are_read_as_strictly_as_bodies(text, code):
    with pytest.raises(BodyError) as info:
        decode_document(text, "guided_json")
    assert (info.value.code, info.value.param) == (code, "guided_json")


def test_text_that_is_not_json_is_told_apart():
    with pytest.raises(NotJSONError):
        decode_document("get the weather", "messages")


def test_the_workers_grammar_refuses_a_deep_schema_in_the_same_words():
    schema: dict = {"type": "string"}
    for _ in range(MAX_DOCUMENT_DEPTH // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(StructuredOutputError, match=f"the JSON schema is nested more than {MAX_DOCUMENT_DEPTH}"):
        validate({"json_schema": schema})
    assert validate({"json_schema": json.loads(json.dumps(schema["properties"]["a"]))})
