"""One declaration per API field, read two ways: parsing a spec into dataclasses, and the CRD schema.

A field of a spec dataclass is declared with `api_field(...)`: its JSON name, OpenAPI constraints,
default and description. `parse` builds the dataclass from the JSON the API server stored, and
tandem.operator.spec.openapi writes the CRD's schema from the very same declarations, so the
typed spec and the schema `kubectl apply` validates against cannot drift apart.

Parsing enforces the OpenAPI part of each declaration (types, enums, bounds, lengths, patterns)
and fills in declared defaults; the CEL rules (`Rule`) are the API server's to check, except a rule
that carries its Python twin (`check`): the parser enforces that one too, with the same message,
where the operator cannot work without it (a CRD older than the operator lets more through).
A spec the parser refuses raises SpecError naming the field, never anything else.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NewType

# An int-or-string Kubernetes quantity (4, "3500m", "64Gi"), kept as the string the pod spec takes.
Quantity = NewType("Quantity", str)
# An object passed through untouched (a core/v1 Affinity, an EnvVarSource): schema-less here.
FreeForm = NewType("FreeForm", dict)
# A count or a percentage of pods (a PodDisruptionBudget's maxUnavailable: 1 or "25%").
IntOrPercent = NewType("IntOrPercent", str)

QUANTITY_PATTERN = r"^([+]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
PERCENT_PATTERN = r"^(100|[1-9]?[0-9])%$"


class _Missing:
    """No default declared (dataclasses.MISSING would mean the same to @dataclass itself)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
_KEY = "tandem.api"

# api_field keyword -> its OpenAPI spelling; also the order constraints appear in the schema.
CONSTRAINTS = {
    "format": "format",
    "enum": "enum",
    "minimum": "minimum",
    "exclusive_minimum": "exclusiveMinimum",
    "maximum": "maximum",
    "max_length": "maxLength",
    "pattern": "pattern",
    "max_items": "maxItems",
    "max_properties": "maxProperties",
}


class SpecError(ValueError):
    """A spec the operator cannot use; `path` names the field (spec.prefill.replicas)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


@dataclass(frozen=True)
class Rule:
    """A CEL rule (x-kubernetes-validations); `{role}` in the message is filled in per role.

    `check`, when given, is the same rule in Python (True: the value passes): the parser enforces it
    with `explain(value)` as its message when that is given (the numbers), else with `message`.
    `message_expression` is CEL that says the same with the numbers at `kubectl apply`; `message`
    stays the fallback the API server shows when the expression cannot be evaluated.
    """

    rule: str
    message: str
    check: Callable[[Any], bool] | None = dataclasses.field(default=None, compare=False)
    message_expression: str | None = None
    explain: Callable[[Any], str] | None = dataclasses.field(default=None, compare=False)


@dataclass(frozen=True)
class Decl:
    """What the API says about one field, beyond the Python type that the annotation gives."""

    name: str  # the JSON name
    description: str | None = None
    default: Any = MISSING  # a JSON value, as the CRD declares it
    constraints: dict[str, Any] = dataclasses.field(default_factory=dict)  # OpenAPI spelling
    values: dict[str, Any] = dataclasses.field(default_factory=dict)  # a map's values' or a list's items' constraints
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # x-kubernetes-* markers
    rules: tuple[Rule, ...] = ()
    context: dict[str, str] = dataclasses.field(default_factory=dict)  # filled into nested text
    overrides: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # nested Decls


def api_field(
    name: str,
    *,
    description: str | None = None,
    default: Any = MISSING,
    values: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    rules: tuple[Rule, ...] = (),
    context: dict[str, str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    **constraints: Any,
) -> Any:
    """A dataclass field carrying its API declaration (see CONSTRAINTS for the keywords)."""
    unknown = set(constraints) - set(CONSTRAINTS)
    if unknown:
        raise TypeError(f"api_field({name!r}): unknown constraints {sorted(unknown)}")
    if not isinstance(constraints.get("exclusive_minimum", False), bool):  # OpenAPI 3.0, as CRDs take it
        raise TypeError(f"api_field({name!r}): exclusive_minimum is a flag on minimum (True/False), not a bound")
    decl = Decl(
        name, description, default,
        {CONSTRAINTS[k]: v for k, v in constraints.items()},
        dict(values or {}), dict(extra or {}), rules, dict(context or {}), dict(overrides or {}),
    )
    return dataclasses.field(metadata={_KEY: decl})


def fill(text: str, context: dict[str, str]) -> str:
    """`{role}` and friends filled in from the context (plain replacement: CEL has braces too)."""
    for key, value in context.items():
        text = text.replace("{" + key + "}", value)
    return text


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A class's resolved annotations (resolving them is the slow part of parsing)."""
    return typing.get_type_hints(cls)


def declared_fields(cls: type, overrides: dict[str, dict[str, Any]]) -> list[tuple[str, Any, Decl]]:
    """(attribute, type, declaration) per field of a spec dataclass, overrides applied."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        decl = f.metadata.get(_KEY)
        if decl is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with api_field")
        out.append((f.name, hints[f.name], dataclasses.replace(decl, **overrides.get(decl.name, {}))))
    stray = set(overrides) - {decl.name for _, _, decl in out}
    if stray:
        raise TypeError(f"overrides name no field of {cls.__name__}: {sorted(stray)}")
    return out


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(X, True) for `X | None`, (tp, False) otherwise."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def rules_of(cls: type) -> tuple[Rule, ...]:
    """The CEL rules a spec dataclass declares about itself (class attribute RULES)."""
    return tuple(getattr(cls, "RULES", ()))


def parse(cls: type, value: Any, path: str, context: dict[str, str] | None = None,
          overrides: dict[str, dict[str, Any]] | None = None) -> Any:
    """JSON (as the API server stored it) -> an instance of the spec dataclass `cls`."""
    if not isinstance(value, dict):
        raise SpecError(path, f"expected an object, got {_show(value)}")
    kwargs = {}
    for attr, tp, decl in declared_fields(cls, overrides or {}):
        inner, optional = unwrap_optional(tp)
        sub = f"{path}.{decl.name}"
        raw = value.get(decl.name)
        if raw is None and decl.default is not MISSING:
            raw = copy.deepcopy(decl.default)
        if raw is None:
            if not optional:
                raise SpecError(sub, "required")
            kwargs[attr] = None
            continue
        kwargs[attr] = _parse_value(inner, raw, sub, decl, dict(context or {}))
    obj = cls(**kwargs)
    _check_rules(rules_of(cls), obj, path, context or {})
    return obj


def _check_rules(rules: tuple[Rule, ...], obj: Any, path: str, context: dict[str, str]) -> None:
    """The rules with a Python twin; the first one broken raises SpecError with the rule's message."""
    for rule in rules:
        if rule.check is not None and not rule.check(obj):
            raise SpecError(path, fill(rule.explain(obj) if rule.explain else rule.message, context))


def _parse_value(tp: Any, raw: Any, path: str, decl: Decl, context: dict[str, str]) -> Any:
    if dataclasses.is_dataclass(tp):
        context = context | decl.context
        obj = parse(tp, raw, path, context, decl.overrides)
        _check_rules(decl.rules, obj, path, context)
        return obj
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        if not isinstance(raw, list):
            raise SpecError(path, f"expected a list, got {_show(raw)}")
        _check(decl.constraints, raw, path)
        item = Decl(decl.name, constraints=decl.values, context=decl.context)
        return tuple(_parse_value(args[0], v, f"{path}[{i}]", item, context) for i, v in enumerate(raw))
    if origin is dict:
        if not isinstance(raw, dict):
            raise SpecError(path, f"expected an object, got {_show(raw)}")
        _check(decl.constraints, raw, path)
        value = Decl(decl.name, constraints=decl.values)
        return {k: _parse_value(args[1], v, f"{path}.{k}", value, context) for k, v in raw.items()}
    value = _scalar(tp, raw, path)
    _check(decl.constraints, value, path)
    _check_rules(decl.rules, value, path, context)
    return value


def _scalar(tp: Any, raw: Any, path: str) -> Any:
    """Type-checks one JSON scalar (a Quantity may be a number: it becomes its string)."""
    if tp is FreeForm:
        if isinstance(raw, dict):
            return raw
    elif tp is Quantity:
        if isinstance(raw, str):
            _check({"pattern": QUANTITY_PATTERN}, raw, path)
            return raw
        if isinstance(raw, int) and not isinstance(raw, bool):
            return str(raw)
    elif tp is IntOrPercent:  # kept as the JSON had it: an int, or a string like "25%"
        if isinstance(raw, str):
            _check({"pattern": PERCENT_PATTERN}, raw, path)
            return raw
        if isinstance(raw, int) and not isinstance(raw, bool):
            _check({"minimum": 0}, raw, path)
            return raw
    elif tp is bool:
        if isinstance(raw, bool):
            return raw
    elif tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
    elif tp is float:
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return raw  # an int stays an int: the config file says `1`, as the CR did
    elif tp is str:
        if isinstance(raw, str):
            return raw
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [m.value for m in tp]
        if raw in values:
            return tp(raw)
        raise SpecError(path, f"must be one of {', '.join(map(str, values))}, got {_show(raw)}")
    else:
        raise TypeError(f"{path}: no JSON mapping for {tp!r}")
    return _wrong_type(tp, raw, path)


def _wrong_type(tp: Any, raw: Any, path: str) -> Any:
    want = {FreeForm: "an object", Quantity: "a quantity (a number or a string like 64Gi)",
            IntOrPercent: "a number of pods or a percentage like 25%",
            bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]
    raise SpecError(path, f"expected {want}, got {_show(raw)}")


def _check(constraints: dict[str, Any], value: Any, path: str) -> None:
    """The OpenAPI constraints of one value; the first one broken raises SpecError."""
    c = constraints
    if "enum" in c and value not in c["enum"]:
        raise SpecError(path, f"must be one of {', '.join(map(str, c['enum']))}, got {_show(value)}")
    if "minimum" in c:
        if c.get("exclusiveMinimum") and value <= c["minimum"]:
            raise SpecError(path, f"must be greater than {c['minimum']}, got {value}")
        if value < c["minimum"]:
            raise SpecError(path, f"must be at least {c['minimum']}, got {value}")
    if "maximum" in c and value > c["maximum"]:
        raise SpecError(path, f"must be at most {c['maximum']}, got {value}")
    for key, what in (("maxLength", "characters"), ("maxItems", "items"), ("maxProperties", "keys")):
        if key in c and len(value) > c[key]:
            raise SpecError(path, f"must have at most {c[key]} {what}, has {len(value)}")
    if "pattern" in c and not re.search(c["pattern"], value):
        raise SpecError(path, f"must match {c['pattern']}, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def to_json(obj: Any) -> Any:
    """A parsed spec (or part of one) back to JSON: None fields left out, JSON names restored."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for attr, _, decl in declared_fields(type(obj), {}):
            value = getattr(obj, attr)
            if value is not None:
                out[decl.name] = to_json(value)
        return out
    if isinstance(obj, tuple | list):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj
