"""The chat-template fields of a request (vLLM's extensions) and `echo`, read from an OpenAI body.

`add_generation_prompt` (default true), `continue_final_message` (default false; not both),
`chat_template_kwargs` (extra template variables, JSON, at most 16 KiB, no name the template is
given itself): tandem.contracts.chat_options applies them in the router and the workers alike.
`echo` prepends the prompt (completions) or, for chat, the last message's content when it is the
assistant's, as vLLM does; with logprobs it would need the prompt's logprobs, which are refused.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.contracts.chat_options import RESERVED
from tandem.router.errors import bad_request
from tandem.router.openai_schema import Endpoint

MAX_KWARGS_CHARS = 16 * 1024


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean.", key)
    return v


def chat_options(body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat-template options that differ from the defaults, or None."""
    gen = _bool(body, "add_generation_prompt", True)
    cont = _bool(body, "continue_final_message", False)
    if gen and cont and body.get("add_generation_prompt") is not None:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                          "continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or len(json.dumps(kwargs)) > MAX_KWARGS_CHARS:
            raise bad_request(f"'chat_template_kwargs' must be an object of at most {MAX_KWARGS_CHARS} "
                              "characters.", "chat_template_kwargs")
        clash = sorted(k for k in kwargs if k in RESERVED or not k.isidentifier())
        if clash:
            raise bad_request(f"'chat_template_kwargs' may not set {clash[0][:40]!r}.", "chat_template_kwargs")
    out: dict[str, Any] = {}
    if not gen or cont:
        out["add_generation_prompt"] = gen and not cont
    if cont:
        out["continue_final_message"] = True
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out or None


def echo_text(body: dict[str, Any], endpoint: Endpoint, messages: list[dict[str, Any]] | None,
              prompt: str | None) -> str | None:
    """What `echo` puts before the output: None when not asked; for a completion prompt of token
    ids the caller decodes them (it has the tokenizer)."""
    if not _bool(body, "echo", False):
        return None
    if body.get("logprobs") not in (None, False):
        raise bad_request("'echo' with 'logprobs' needs the prompt's logprobs, which this server does not "
                          "compute yet.", "echo")
    if endpoint is Endpoint.COMPLETION:
        return prompt if prompt is not None else ""
    last = (messages or [{}])[-1]
    return last.get("content") or "" if last.get("role") == "assistant" else ""


def decode_echo(tokens: Any, ids: list[int]) -> str:
    """The text of a token-id prompt for `echo`, with the router's tokenizer (tokenizer_sync.py)."""
    if tokens is None or not tokens.active or tokens.tokenizer is None:
        raise bad_request("'echo' of a prompt given as token ids needs the router's tokenizer, which is not "
                          "loaded: send the prompt as text.", "echo")
    return tokens.tokenizer.decode(ids)
