"""A JSON schema the structured-output tests constrain a random-weight model with, and its check
(written out, so the tests need no JSON-schema library)."""

from __future__ import annotations

from typing import Any

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def validate_person(doc: Any) -> None:
    """AssertionError unless `doc` satisfies PERSON."""
    assert isinstance(doc, dict) and set(doc) == {"name", "age", "tags"}, doc
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 12, doc
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool) and 0 <= doc["age"] <= 150, doc
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3, doc
    assert all(isinstance(t, str) and len(t) <= 5 for t in doc["tags"]), doc
