"""`tools`, `tool_choice` and `parallel_tool_calls`: read from the body, rendered through the model's
chat template (its `tools` variable, as transformers passes it), enforced by a grammar for
`required` and a named function, and the calls found in the output (tool_parsers.py) returned as
OpenAI `tool_calls`, streamed as deltas once each call is complete (ToolStream).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tandem.contracts.json_body import BodyError, NotJSONError, check_document, decode_document
from tandem.router.errors import bad_request
from tandem.router.tool_parsers import PARSERS, ToolCall

MAX_TOOLS = 128


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]
    choice: str  # none | auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str = "hermes"

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def grammar_spec(self) -> dict[str, Any] | None:
        """The Lark grammar that makes the output a call (required, named); None for auto/none."""
        if self.choice not in ("required", "named"):
            return None
        tools = [t for t in self.tools if self.choice == "required" or t["function"]["name"] == self.name]
        return {"lark": PARSERS[self.parser].grammar(tools, self.parallel and self.choice == "required")}


def _tool(t: Any, i: int) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
        raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise bad_request(f"tools[{i}].function.name must be a string of 1 to 64 characters.", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
    try:  # the limit every JSON document in a request has (it travels on inside a grammar)
        check_document(params, "tools", f"tools[{i}].function.parameters")
    except BodyError as e:
        raise bad_request(str(e), "tools", e.code) from None
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"tools[{i}].function.description must be a string.", "tools")
    return {"type": "function", "function": {k: v for k, v in fn.items() if k in ("name", "description",
                                                                                     "parameters", "strict")}}


def parse_tools(body: dict[str, Any], parser: str) -> ToolRequest | None:
    """The request's tools, or None when it has none; a 400 naming the field otherwise."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'.", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} functions.", "tools")
    tools = [_tool(t, i) for i, t in enumerate(raw)]
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    req = ToolRequest(tools, "auto", parallel=parallel, parser=parser)
    if choice in (None, "auto", "none", "required"):
        req.choice = choice or "auto"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and \
            isinstance(choice["function"].get("name"), str):
        req.choice, req.name = "named", choice["function"]["name"]
        if req.name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {req.name[:64]!r}, which is not in 'tools'.", "tool_choice")
    else:
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                          "'function': {'name': ...}}.", "tool_choice")
    return req


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def message(text: str, tools: ToolRequest | None) -> tuple[dict[str, Any], bool]:
    """The assistant message for a whole output, and whether it called tools."""
    if tools is None or not tools.parses:
        return {"role": "assistant", "content": text}, False
    content, calls = PARSERS[tools.parser].parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content, "tool_calls": openai_calls(calls)}, True


@dataclass
class ToolStream:
    """One choice's streamed text with tool calls taken out: content deltas go out as they come
    (holding back what could be the start of a call), the calls as `tool_calls` deltas at the end."""

    tools: ToolRequest
    text: str = ""
    sent: int = 0  # characters of `text` sent as content
    in_call: bool = False

    def _call_start(self) -> int | None:
        if self.tools.parser == "llama3_json":
            body = self.text.lstrip()
            return len(self.text) - len(body) if body.startswith(("{", "<|python_tag|>")) else None
        at = self.text.find(PARSERS[self.tools.parser].marker)
        return at if at >= 0 else None

    def _holdback(self) -> int:
        """Characters at the end that may still begin a call."""
        if self.tools.parser == "llama3_json":
            body = self.text.lstrip()
            return len(self.text) if not body or "<|python_tag|>".startswith(body) else 0
        marker = PARSERS[self.tools.parser].marker
        return next((k for k in range(min(len(marker) - 1, len(self.text)), 0, -1)
                     if marker.startswith(self.text[-k:])), 0)

    def feed(self, delta: str) -> str:
        """The content to send now."""
        self.text += delta
        if self.in_call:
            return ""
        start = self._call_start()
        if start is not None:
            self.in_call = True
            end = max(start, self.sent)
        else:
            end = max(self.sent, len(self.text) - self._holdback())
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left to send: content not sent yet (all of it when no call parses), and the calls
        as tool_calls delta entries."""
        _, calls = PARSERS[self.tools.parser].parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        return "", [{"index": i} | c for i, c in enumerate(openai_calls(calls))]


def arguments_as_objects(messages: list[dict[str, Any]]) -> None:
    """Assistant tool_calls' `arguments` (JSON text in OpenAI's API) as objects, which is what chat
    templates iterate over (vLLM does the same); text that is not JSON stays text, JSON nested too
    deep (or holding what no JSON body may) is a 400 naming `messages`."""
    for i, m in enumerate(messages):
        for j, c in enumerate(m.get("tool_calls") or ()):
            fn = c.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = decode_document(fn["arguments"], "messages",
                                                      f"messages[{i}].tool_calls[{j}].function.arguments")
                except NotJSONError:
                    pass
                except BodyError as e:
                    raise bad_request(str(e), "messages", e.code) from None
