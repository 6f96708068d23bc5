"""Tool calls in the text models write, in the formats common models use, both ways: the grammar
that makes a model write one (tool_choice `required` or a named function, structured_output's
Lark with llguidance's `%json`), and the parser that finds them in the output.

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Hermes, Qwen 2/2.5);
- `llama3_json`: `{"name": ..., "parameters": {...}}` as the whole answer, several joined by `;`,
  optionally after `<|python_tag|>` (Llama 3.1+ JSON tool calling);
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _call_schema(tool: dict[str, Any], args_key: str) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def _one_of(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    calls = [_call_schema(t, args_key) for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"x-guidance": JSON_STYLE} | schema


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class Hermes:
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        rep = "+" if parallel else ""
        return (f'start: (call "\\n"?){rep}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
                f"body: %json {json.dumps(_one_of(tools, 'arguments'))}")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for m in self._block.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        content = text[: text.index(self.marker)].strip()
        return content or None, calls


class Llama3Json:
    marker = "{"  # at the start of the answer (after <|python_tag|> or whitespace)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        rep = ' (";" call)*' if parallel else ""
        return f"start: call{rep}\ncall: %json {json.dumps(_one_of(tools, 'parameters'))}"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        dec = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, end = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in "; \n\t":
                i += 1
        return None, calls


class Mistral:
    marker = "[TOOL_CALLS]"

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        items = {"type": "array", "items": _one_of(tools, "arguments"), "minItems": 1}
        if not parallel:
            items["maxItems"] = 1
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json {json.dumps({"x-guidance": JSON_STYLE} | items)}'

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.marker not in text:
            return text, []
        head, _, tail = text.partition(self.marker)
        try:
            objs = json.loads(tail.strip())
        except ValueError:
            return text, []
        calls = [_call(o, "arguments") for o in (objs if isinstance(objs, list) else [objs])]
        if not calls or any(c is None for c in calls):
            return text, []
        return head.strip() or None, [c for c in calls if c is not None]


PARSERS: dict[str, Any] = {"hermes": Hermes(), "llama3_json": Llama3Json(), "mistral": Mistral()}
