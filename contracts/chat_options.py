"""How chat messages go through a chat template, the same in the router (its own Jinja rendering)
and in the workers (transformers' apply_chat_template): add_generation_prompt, continue_final_message
(the last message left open for the model to continue, as transformers cuts it), the client's
chat_template_kwargs as extra template variables (a name the template itself is given is refused),
and the request's `tools` as the template's `tools` variable.
"""

from __future__ import annotations

from typing import Any

RESERVED = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
                      "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now"})


def template_args(options: dict[str, Any] | None) -> tuple[bool, bool, dict[str, Any]]:
    """(add_generation_prompt, continue_final_message, extra template variables)."""
    o = options or {}
    extra = dict(o.get("chat_template_kwargs") or {})
    if o.get("tools"):
        extra["tools"] = o["tools"]  # the template's own variable, as transformers passes it
    return (bool(o.get("add_generation_prompt", True)), bool(o.get("continue_final_message", False)), extra)


def cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """The rendering up to the end of the last message's content (what follows it closes the turn),
    as transformers' continue_final_message does; ValueError when the content is not in it."""
    final = str(messages[-1].get("content") or "")
    for text in (final, final.strip()):
        if text and text in rendered:
            return rendered[: rendered.rindex(text) + len(text)]
    raise ValueError("continue_final_message: the last message's content is not in the rendered chat")
