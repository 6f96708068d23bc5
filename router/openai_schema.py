"""Every request field the router knows, declared once: honoured, refused, or ignored.

The rule (issue 20): a field a client sends is honoured, or refused with a 400 naming it; nothing a
server like vLLM honours is ever silently ignored. `IGNORED` is only for fields no server
implements (OpenAI platform features: `store`, `metadata`, ...); they are logged, as vLLM logs
unknown fields. A refused field set to its inert value (`n: 1`, `echo: false`, `tool_choice:
"none"`, ...) asks for nothing and passes. validation.py parses every HONOURED field; the test
tests/router/test_every_parameter_is_honoured_or_refused.py walks vLLM's request fields and this
table, and fails if a field is in neither.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Support(enum.StrEnum):
    HONOURED = "honoured"
    REFUSED = "refused"  # a 400 naming the field unless its value is inert
    IGNORED = "ignored"  # no server implements it: logged, no effect


class Endpoint(enum.StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"


BOTH = frozenset({Endpoint.CHAT, Endpoint.COMPLETION})
CHAT = frozenset({Endpoint.CHAT})
COMPLETION = frozenset({Endpoint.COMPLETION})


@dataclass(frozen=True)
class FieldSpec:
    support: Support
    endpoints: frozenset[Endpoint] = BOTH
    inert: tuple[Any, ...] = (None,)  # values that ask for nothing (a refused field may carry them)
    why: str = ""  # for REFUSED and IGNORED: said in the 400 or the log


def _h(endpoints: frozenset[Endpoint] = BOTH) -> FieldSpec:
    return FieldSpec(Support.HONOURED, endpoints)


def _r(why: str, *inert: Any, endpoints: frozenset[Endpoint] = BOTH) -> FieldSpec:
    return FieldSpec(Support.REFUSED, endpoints, (None, *inert), why)


def _i(why: str, endpoints: frozenset[Endpoint] = BOTH) -> FieldSpec:
    return FieldSpec(Support.IGNORED, endpoints, (), why)


_NOT_YET = "is not supported by this server yet"

FIELDS: dict[str, FieldSpec] = {
    # the OpenAI API
    "model": _h(), "messages": _h(CHAT), "prompt": _h(COMPLETION),
    "max_tokens": _h(), "max_completion_tokens": _h(CHAT),
    "temperature": _h(), "top_p": _h(), "seed": _h(), "stop": _h(), "stream": _h(), "stream_options": _h(),
    "presence_penalty": _h(), "frequency_penalty": _h(), "logit_bias": _h(),
    "logprobs": _h(), "top_logprobs": _h(CHAT),
    "response_format": _h(),
    "n": _h(),
    "best_of": _r("best_of > 1 is not supported by this server", 1, endpoints=COMPLETION),
    "echo": _h(),
    "suffix": _r("'suffix' (fill in the middle) is not supported by this server", "", endpoints=COMPLETION),
    "tools": _h(CHAT), "tool_choice": _h(CHAT), "parallel_tool_calls": _h(CHAT),
    "functions": _r("'functions' is OpenAI's deprecated form: send 'tools'", [], endpoints=CHAT),
    "function_call": _r("'function_call' is OpenAI's deprecated form: send 'tool_choice'", "none",
                        endpoints=CHAT),
    "reasoning_effort": _r("'reasoning_effort' is not supported by this server", endpoints=CHAT),
    "user": _i("an end-user id for OpenAI's abuse monitoring; vLLM ignores it too"),
    "service_tier": _i("an OpenAI platform setting"), "store": _i("an OpenAI platform setting"),
    "metadata": _i("an OpenAI platform setting"), "modalities": _i("an OpenAI platform setting", CHAT),
    "audio": _r("audio output is not supported by this server", endpoints=CHAT),
    "prediction": _i("an OpenAI latency hint", CHAT), "web_search_options": _i("an OpenAI tool", CHAT),
    "verbosity": _i("an OpenAI platform setting", CHAT), "safety_identifier": _i("an OpenAI platform setting"),
    "prompt_cache_key": _i("an OpenAI platform setting"),
    # vLLM's sampling extensions
    "top_k": _h(), "min_p": _h(), "repetition_penalty": _h(), "min_tokens": _h(), "stop_token_ids": _h(),
    "ignore_eos": _h(),
    "use_beam_search": _r("beam search is not supported by this server", False),
    "length_penalty": _r("length_penalty (beam search) is not supported by this server", 1, 1.0),
    "include_stop_str_in_output": _r("'include_stop_str_in_output' " + _NOT_YET, False),
    "skip_special_tokens": _r("special tokens are always skipped in the text by this server", True),
    "spaces_between_special_tokens": _r("'spaces_between_special_tokens' " + _NOT_YET, True),
    "truncate_prompt_tokens": _r("prompt truncation " + _NOT_YET),
    "truncation_side": _r("prompt truncation " + _NOT_YET),
    "prompt_logprobs": _r("prompt logprobs " + _NOT_YET),
    "allowed_token_ids": _r("'allowed_token_ids' " + _NOT_YET),
    "bad_words": _r("'bad_words' " + _NOT_YET, []),
    "logprob_token_ids": _r("'logprob_token_ids' " + _NOT_YET),
    "logits_processors": _r("custom logits processors are not supported by this server"),
    "watermarking": _r("watermarking is not supported by this server", False),
    "thinking_token_budget": _r("'thinking_token_budget' is not supported by this server"),
    "repetition_detection": _r("'repetition_detection' " + _NOT_YET),
    "stream_interval": _r("'stream_interval' " + _NOT_YET, 1),
    # vLLM's structured output
    "structured_outputs": _h(), "guided_json": _h(), "guided_regex": _h(), "guided_choice": _h(),
    "guided_grammar": _h(),
    "guided_decoding_backend": _i("one grammar engine serves every request here (llguidance)"),
    "guided_whitespace_pattern": _r("JSON whitespace is fixed (compact) by this server"),
    # vLLM's chat-template and prompt extensions
    "chat_template_kwargs": _h(CHAT), "add_generation_prompt": _h(CHAT), "continue_final_message": _h(CHAT),
    "chat_template": _r("a request's own chat template is not accepted: the model's template is used",
                        endpoints=CHAT),
    "documents": _r("'documents' (RAG templates) is not supported by this server", endpoints=CHAT),
    "add_special_tokens": _r("'add_special_tokens' other than the default is not supported by this server",
                             endpoints=BOTH),
    "include_reasoning": _r("reasoning parsing is not supported by this server", True, endpoints=CHAT),
    "prompt_embeds": _r("prompt embeddings are not supported by this server", endpoints=COMPLETION),
    "mm_processor_kwargs": _r("multimodal input is not supported by this server", {}),
    "media_io_kwargs": _r("multimodal input is not supported by this server", {}),
    "return_tokens_as_token_ids": _r("'return_tokens_as_token_ids' " + _NOT_YET, False),
    "return_token_ids": _r("'return_token_ids' " + _NOT_YET, False),
    "return_prompt_text": _r("'return_prompt_text' " + _NOT_YET, False),
    "return_token_offsets": _i("vLLM reads it on its render endpoints only"),
    "return_mm_kwargs": _i("vLLM reads it on its render endpoints only"),
    "routed_experts_prompt_start": _r("routed-expert data is not returned by this server", 0),
    "priority": _r("priority scheduling is not supported by this server", 0),
    "request_id": _r("this server assigns request ids itself (X-Request-Id)"),
    "session_id": _r("'session_id' is not supported by this server"),
    "cache_salt": _h(),
    "kv_transfer_params": _r("this server does the KV handoff itself"),
    "ec_transfer_params": _r("encoder-cache transfer is not supported by this server"),
    "vllm_xargs": _r("vLLM extension arguments are not supported by this server"),
}

# The chat message fields passed to the chat template; others are refused.
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


def inert(name: str, value: Any) -> bool:
    """The value asks for nothing that the field could do."""
    return any(value is v or (type(value) is type(v) and value == v) for v in FIELDS[name].inert)


def declared(endpoint: Endpoint) -> dict[str, FieldSpec]:
    """The fields of one endpoint."""
    return {k: v for k, v in FIELDS.items() if endpoint in v.endpoints}
