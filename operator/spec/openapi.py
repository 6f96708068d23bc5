"""The OpenAPI v3 schema of a spec dataclass, written from its api_field declarations.

The CRD generator (tandem.operator.crd) calls `object_schema(InferenceServiceSpec)`; the same
declarations drive the parser (fields.parse), so the CRD and the typed spec cannot disagree.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

from tandem.operator.spec.fields import (
    MISSING,
    PERCENT_PATTERN,
    QUANTITY_PATTERN,
    Decl,
    FreeForm,
    IntOrPercent,
    Quantity,
    Rule,
    declared_fields,
    fill,
    rules_of,
    unwrap_optional,
)

_SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string"}
# What a property's schema lists after its own constraints and description, in this order.
_NESTED = ("required", "properties", "items", "x-kubernetes-validations")


def object_schema(cls: type, context: dict[str, str] | None = None,
                  overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A spec dataclass as an OpenAPI object: its fields, which are required, its CEL rules.

    A field is required when it has neither a default nor an optional (`X | None`) type.
    """
    context = context or {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for _, tp, decl in declared_fields(cls, overrides or {}):
        inner, optional = unwrap_optional(tp)
        if not optional and decl.default is MISSING:
            required.append(decl.name)
        properties[decl.name] = field_schema(inner, decl, context)
    schema: dict[str, Any] = {"type": "object"}
    if required:
        schema["required"] = required
    schema["properties"] = properties
    rules = rules_of(cls)
    if rules:
        schema["x-kubernetes-validations"] = _validations(rules, context)
    return schema


def field_schema(tp: Any, decl: Decl, context: dict[str, str]) -> dict[str, Any]:
    """One property: its type's schema, then constraints, default, description, rules."""
    context = context | decl.context
    schema = _type_schema(tp, decl, context)
    body = {k: v for k, v in schema.items() if k not in _NESTED}
    body |= decl.constraints
    if decl.default is not MISSING:
        body["default"] = decl.default
    if decl.description:
        body["description"] = fill(decl.description, context)
    body |= decl.extra
    body |= {k: schema[k] for k in _NESTED[:-1] if k in schema}
    validations = schema.get(_NESTED[-1], []) + _validations(decl.rules, context)
    if validations:
        body[_NESTED[-1]] = validations
    return body


def _validations(rules: tuple[Rule, ...], context: dict[str, str]) -> list[dict[str, str]]:
    out = []
    for r in rules:
        item = {"rule": r.rule, "message": fill(r.message, context)}
        if r.message_expression:
            item["messageExpression"] = fill(r.message_expression, context)
        out.append(item)
    return out


def _type_schema(tp: Any, decl: Decl, context: dict[str, str]) -> dict[str, Any]:
    if dataclasses.is_dataclass(tp):
        return object_schema(tp, context, decl.overrides)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        return {"type": "array", "items": _type_schema(args[0], Decl(decl.name), context) | decl.values}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1], Decl(decl.name), context)
                | decl.values}
    if tp is Quantity:
        return {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                "pattern": QUANTITY_PATTERN}
    if tp is IntOrPercent:
        return {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                "minimum": 0, "pattern": PERCENT_PATTERN}
    if tp is FreeForm:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [m.value for m in tp]}
    raise TypeError(f"{decl.name}: no OpenAPI type for {tp!r}")
