"""The served model's tokenizer and chat template, in the router, without torch or transformers.

The router tokenizes every request once and sends token ids to the workers, so token counts are
exact where limits and routing are decided (`maxPromptTokens`, the short-prompt bypass, prefix
block hashes) and every worker sees the same ids. It must tokenize exactly as the workers'
`transformers` tokenizer does: `tokenizer.json` through the `tokenizers` library (its
post-processor adds BOS for plain prompts), and chat messages rendered through the model's chat
template in a sandboxed Jinja environment set up as `transformers.apply_chat_template` sets it up,
then encoded without special tokens (the template writes them). The tests compare both paths with
`transformers` token for token.

The files come from a model folder, or from a worker's `/internal/tokenizer` (so a router pod needs
no model volume).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.contracts.chat_options import cut_after_final_message, template_args
from tandem.contracts.tokenizer_files import TOKENIZER_FILES


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template (a client error)."""


def _special_token(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(config: dict[str, Any], jinja_file: str | None) -> str | None:
    if jinja_file:
        return jinja_file
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


@dataclass
class RouterTokenizer:
    """Encodes prompts and chat messages exactly as the workers do."""

    tokenizer: Any  # tokenizers.Tokenizer
    special_tokens: dict[str, str]
    chat_template: Any | None  # a compiled jinja2 Template

    @classmethod
    def from_files(cls, files: dict[str, str]) -> RouterTokenizer:
        """From the texts of TOKENIZER_FILES (tokenizer.json required)."""
        from tokenizers import Tokenizer

        if not files.get("tokenizer.json"):
            raise ValueError("the model has no tokenizer.json (a fast tokenizer is required)")
        config = json.loads(files.get("tokenizer_config.json") or "{}")
        special = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if (v := _special_token(config.get(k))) is not None}
        template = _chat_template(config, files.get("chat_template.jinja"))
        return cls(Tokenizer.from_str(files["tokenizer.json"]), special,
                   _compile(template) if template else None)

    @classmethod
    def from_dir(cls, path: str | Path) -> RouterTokenizer:
        path = Path(path)
        return cls.from_files({name: (path / name).read_text() for name in TOKENIZER_FILES
                               if (path / name).is_file()})

    def encode_plain(self, text: str) -> list[int]:
        """Text without the special tokens a prompt gets."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt: special tokens as the tokenizer's post-processor adds them."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict[str, Any]], options: dict[str, Any] | None = None) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template: use /v1/completions")
        import jinja2

        add_generation_prompt, continue_final, extra = template_args(options)
        try:
            rendered = self.chat_template.render(**extra, messages=messages,
                                                 add_generation_prompt=add_generation_prompt and not continue_final,
                                                 **self.special_tokens)
            return cut_after_final_message(rendered, messages) if continue_final else rendered
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"cannot apply the chat template to messages: {e}") from e
        except Exception as e:  # noqa: BLE001 - a template fails on odd messages in many ways, as a worker's does
            raise ChatTemplateError(f"cannot apply the chat template to messages: {e!r}") from e

    def encode_chat(self, messages: list[dict[str, Any]], options: dict[str, Any] | None = None) -> list[int]:
        """Chat messages through the template; the template writes the special tokens itself."""
        return self.tokenizer.encode(self.render_chat(messages, options), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Token ids back to text, special tokens skipped (as the workers' streamed text is)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)
