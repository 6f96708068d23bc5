"""Reading a JSON request body strictly, the same way at the router's public door and at the
workers' internal API.

Python's `json` accepts what no later step can handle: `NaN` and `Infinity`, `1e400` (inf),
integers of thousands of digits, `"\\ud800"` (a lone surrogate that no encoder takes), nesting deep
enough to raise RecursionError, and bodies in whatever charset a header names. Each of those is a
`BodyError` here (a 4xx with a message that says what to send), so neither process answers 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 32  # the deepest legitimate body (chat content parts) is 5 levels
# A JSON document inside a request (a schema, a tool call's arguments, in a string or not): deeper
# than any real one, and shallow enough to fit a worker's body (MAX_DEPTH) wherever it travels on;
# the deepest place is a tool call's arguments, DOCUMENT_PREFIX_DEPTH levels down
# (messages[i].tool_calls[j].function.arguments).
MAX_DOCUMENT_DEPTH = 24
DOCUMENT_PREFIX_DEPTH = 6
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what a 64-bit seed or id can hold, signed or not
JSON_TYPE = "application/json"


class BodyError(ValueError):
    """A request body refused before anything reads its fields: an HTTP status and an OpenAI code."""

    def __init__(self, message: str, status: int = 400, code: str | None = "invalid_json",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


class NotJSONError(BodyError):
    """A string that should hold a JSON document holds something else (its caller may keep it as text)."""


def check_content_type(header: str | None) -> None:
    """No Content-Type, or a JSON one (application/json, */*+json) in UTF-8; else 415."""
    if not header or not header.strip():
        return
    media, *params = (p.strip() for p in header.split(";"))
    media = media.lower()
    if media != JSON_TYPE and not (media.endswith("+json") and "/" in media):
        raise BodyError(f"Content-Type {media!a} is not supported: send a JSON body with "
                        f"'Content-Type: {JSON_TYPE}'.", 415, "unsupported_media_type")
    for p in params:
        key, _, value = p.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise BodyError(f"charset {value.strip()!a} is not supported: JSON bodies are UTF-8.",
                            415, "unsupported_media_type")


def _refuse_constant(name: str) -> Any:
    raise BodyError(f"{name} is not a JSON number: send a finite number.", code="invalid_value")


def _where(path: tuple[Any, ...]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _param(path: tuple[Any, ...]) -> str | None:
    return path[0] if path and isinstance(path[0], str) else None


def _check_str(s: str, path: tuple[Any, ...]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(f"the string at {_where(path)} is not valid Unicode (a lone surrogate such as "
                        "\\ud800): send UTF-8 text.", code="invalid_value", param=_param(path)) from None


def _check_scalar(v: Any, path: tuple[Any, ...]) -> None:
    if isinstance(v, str):
        _check_str(v, path)
    elif isinstance(v, bool) or v is None:
        return
    elif isinstance(v, int):
        if not INT_MIN <= v <= INT_MAX:
            raise BodyError(f"the integer at {_where(path)} is out of range (64 bits at most).",
                            code="invalid_value", param=_param(path))
    elif isinstance(v, float) and not math.isfinite(v):
        raise BodyError(f"the number at {_where(path)} is too large to be finite.",
                        code="invalid_value", param=_param(path))


def _uniform_numbers(items: list[Any], path: tuple[Any, ...]) -> bool:
    """Fast path for long lists of one number type (token ids): checked at C speed."""
    kinds = set(map(type, items))
    if kinds == {int}:
        if min(items) < INT_MIN or max(items) > INT_MAX:
            raise BodyError(f"an integer in {_where(path)} is out of range (64 bits at most).",
                            code="invalid_value", param=_param(path))
        return True
    if kinds == {float}:
        if not all(map(math.isfinite, items)):
            raise BodyError(f"a number in {_where(path)} is too large to be finite.",
                            code="invalid_value", param=_param(path))
        return True
    return False


def check_value(doc: Any, max_depth: int = MAX_DEPTH, what: str = "the body", param: str | None = None) -> None:
    """Depth, integer range, finiteness and valid Unicode everywhere in a parsed body (iteratively:
    a deep body must not recurse here either). `param` names every error (a document's field)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict | list) and len(path) >= max_depth:
            raise BodyError(f"{what} is nested more than {max_depth} levels deep.", param=param or _param(path))
        try:
            if isinstance(value, dict):
                for k, v in value.items():
                    _check_str(k, path)  # a key: located by the object that holds it
                    stack.append((v, (*path, k)))
            elif isinstance(value, list):
                if value and _uniform_numbers(value, path):
                    continue
                stack.extend((v, (*path, i)) for i, v in enumerate(value))
            else:
                _check_scalar(value, path)
        except BodyError as e:
            if param is None:
                raise
            raise BodyError(f"{what}: {e}", code=e.code, param=param) from None


def decode_json(raw: bytes, content_type: str | None = None) -> Any:
    """The parsed body, or BodyError: bad Content-Type or charset (415), not UTF-8, not JSON, or a
    value nothing downstream could use (400)."""
    check_content_type(content_type)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"the body is not valid UTF-8 (byte {exc.start}): send UTF-8 JSON.") from None
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise BodyError(f"the body is nested more than {MAX_DEPTH} levels deep.") from None
    except json.JSONDecodeError as exc:
        raise BodyError(f"the body is not valid JSON: {exc}") from None
    except BodyError:
        raise
    except ValueError:  # an integer literal longer than Python converts
        raise BodyError("the body holds an integer literal thousands of digits long: integers are 64 bits "
                        "at most.", code="invalid_value") from None
    check_value(doc)
    return doc


def check_document(doc: Any, param: str, what: str | None = None) -> None:
    """A JSON document the request holds (a JSON schema, a tool's parameters) checked like a body, nested
    at most MAX_DOCUMENT_DEPTH levels; BodyError naming `param` (and saying `what` it is) otherwise."""
    check_value(doc, MAX_DOCUMENT_DEPTH, what or f"the JSON in '{param}'", param)


def decode_document(text: str, param: str, what: str | None = None) -> Any:
    """The JSON document in a string of the request (`guided_json`, `structured_outputs.json`, a tool call's
    `arguments`), read as strictly as a body and nested at most MAX_DOCUMENT_DEPTH levels: every process
    decodes such strings here, so none of them recurses into a hostile one (a 400 naming `param`, never a
    RecursionError). NotJSONError (a BodyError) when the text is not JSON at all."""
    what = what or f"the JSON in '{param}'"
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise BodyError(f"{what} is nested more than {MAX_DOCUMENT_DEPTH} levels deep.", param=param) from None
    except json.JSONDecodeError as exc:
        raise NotJSONError(f"{what} is not valid JSON: {exc}", param=param) from None
    except BodyError as exc:
        raise BodyError(f"{what}: {exc}", code=exc.code, param=param) from None
    except ValueError:  # an integer literal longer than Python converts
        raise BodyError(f"{what} holds an integer literal thousands of digits long: integers are 64 bits at most.",
                        code="invalid_value", param=param) from None
    check_document(doc, param, what)
    return doc
