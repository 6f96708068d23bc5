"""Turns an OpenAI request body into a worker request, or a 400 that names the bad parameter.

Pure: no I/O, so every refusal is unit-tested. Which fields are honoured, refused or ignored is
declared once, in openai_schema.py: a refused field with a value that asks for something is a 400
naming it, an ignored one (no server implements it) and an unknown one are logged and have no
effect. The honoured ones are parsed here and in sampling_fields.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.contracts import request_limits as defaults
from tandem.contracts.json_body import INT_MAX, INT_MIN
from tandem.contracts.protocol import MAX_CACHE_SALT_CHARS
from tandem.contracts.sampling import SamplingParams, top_k_valid
from tandem.router import request_budget
from tandem.router.chat_fields import chat_options, echo_text
from tandem.router.errors import RouterError, bad_request
from tandem.router.flow_control import SHARED_FLOW
from tandem.router.openai_schema import FIELDS, MESSAGE_FIELDS, Endpoint, Support, inert
from tandem.router.sampling_fields import is_int as _is_int
from tandem.router.sampling_fields import is_number as _is_number
from tandem.router.sampling_fields import is_token_id, parse_controls
from tandem.router.tools import ToolRequest, arguments_as_objects, parse_tools

if TYPE_CHECKING:
    from tandem.router.policies.base import Pinned

__all__ = ["Endpoint", "Limits", "ParsedRequest", "check_model", "check_prompt_tokens", "parse_messages",
           "parse_request"]

log = logging.getLogger("tandem.router")
MAX_N = 16  # choices one request may ask for (each is a sequence on the workers)


@dataclass
class Limits:
    """What one request may ask for; the operator sets these from the router spec."""

    max_tokens_limit: int = defaults.MAX_OUTPUT_TOKENS  # the most output tokens one choice may ask for
    max_request_output_tokens: int = defaults.MAX_REQUEST_OUTPUT_TOKENS  # n x max_tokens (request_budget.py)
    max_request_logprobs: int = defaults.MAX_REQUEST_LOGPROBS  # n x max_tokens x (1 + top_logprobs)
    # when the client sends none: None is the rest of the context (as vLLM does), within max_tokens_limit
    default_max_tokens: int | None = None
    max_prompt_tokens: int | None = None  # checked once the prompt's tokens are known (router or worker)
    max_stop_sequences: int = 16
    max_stop_chars: int = 256  # each stop string: the worker checks them against every new token
    max_messages: int = 4096  # chat messages in one request (each costs template work)
    tool_call_parser: str = "hermes"  # how the model writes tool calls (tool_parsers.py)


@dataclass
class ParsedRequest:
    endpoint: Endpoint
    model: str
    sampling: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # choices (fan_out.py)
    chat_options: dict[str, Any] | None = None  # chat_fields.py: how messages go through the template
    echo: str | None = None  # text `echo` puts before the output (None: not asked)
    echo_ids: bool = False  # echo of a token-id prompt: the text is decoded once tokens are known
    tools: ToolRequest | None = None  # tools.py
    max_tokens_given: bool = True  # False: the default applies (the rest of the context, app.py)
    cache_salt: str | None = None  # the tenant's prefix-cache salt (vLLM's name): shares KV only with the same salt
    pinned: Pinned | None = None  # behind a gateway: the workers its picker chose (set by app.py, not the body)
    flow: tuple[str, int] = (SHARED_FLOW, 0)  # its tenant and priority at flow control (set by app.py, from headers)

    def prompt_chars(self) -> int:
        """Size of the prompt in characters, for an estimate when its tokens are unknown (policies.base)."""
        if self.prompt is not None:
            return len(self.prompt)
        if self.prompt_token_ids is not None:
            return 4 * len(self.prompt_token_ids)
        return sum(len(str(m.get("content") or "")) + 8 for m in self.messages or [])


# Chat roles a template knows; anything else is refused here rather than by a worker's template.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_logged_fields: set[str] = set()  # ignored and unknown fields are logged once each per process


def _check_fields(body: dict[str, Any], endpoint: Endpoint) -> None:
    """400 for a refused field that asks for something; ignored and unknown fields are logged once."""
    for name, value in body.items():
        spec = FIELDS.get(name)
        if spec is None or endpoint not in spec.endpoints:
            if name not in _logged_fields and len(_logged_fields) < 1024:
                _logged_fields.add(name)
                log.info("ignoring the unknown request field %r", name[:64])
            continue
        if spec.support is Support.REFUSED and not inert(name, value):
            raise bad_request(f"'{name}': {spec.why}.", name)
        if spec.support is Support.IGNORED and value is not None and name not in _logged_fields:
            _logged_fields.add(name)
            log.info("ignoring the request field %r: %s", name, spec.why)


def _chat_extras(req: ParsedRequest, body: dict[str, Any], limits: Limits) -> None:
    """Chat-template options and tools: the tools go to the template, their grammar (tool_choice
    required or named) constrains the output."""
    req.chat_options = chat_options(body)
    req.tools = parse_tools(body, limits.tool_call_parser)
    arguments_as_objects(req.messages or [])
    if req.tools is None:
        return
    req.chat_options = (req.chat_options or {}) | {"tools": req.tools.tools}
    spec = req.tools.grammar_spec()
    if spec is not None:
        if req.sampling.structured is not None:
            raise bad_request("tool_choice 'required' or a named function cannot be combined with another "
                              "output format.", "tool_choice")
        req.sampling.structured = spec


def _parse_n(n: Any) -> int:
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be an integer between 1 and {MAX_N}.", "n")
    return n


def _tool_calls(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        for c in v)


def parse_messages(raw: Any, limits: Limits) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list of messages.", "messages")
    if len(raw) > limits.max_messages:
        raise bad_request(f"at most {limits.max_messages} messages are allowed in one request.", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'.", "messages")
        if m["role"] not in ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {sorted(ROLES)}, got {m['role'][:40]!r}.", "messages"
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad_request(
                        f"messages[{i}].content: only text parts are supported.", "messages"
                    )
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content: a text part needs a string 'text'.", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts.", "messages")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_request(f"messages[{i}].{key} must be a string.", "messages")
                msg[key] = m[key]
        if m.get("tool_calls") is not None:
            if not _tool_calls(m["tool_calls"]):
                raise bad_request(f"messages[{i}].tool_calls must be a list of function calls.", "messages")
            msg["tool_calls"] = m["tool_calls"]
        unknown = sorted(k for k in m if k not in MESSAGE_FIELDS and m[k] is not None)
        if unknown:
            raise bad_request(f"messages[{i}].{unknown[0][:40]} is not supported by this server.", "messages")
        out.append(msg)
    return out


def _parse_prompt(raw: Any) -> tuple[str | None, list[int] | None]:
    """A string, a list of one string, a list of token ids, or a list of one such list."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]
    if isinstance(raw, str):
        return raw, None
    if isinstance(raw, list) and raw and all(is_token_id(t) for t in raw):
        return None, list(raw)
    if isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        raise bad_request("token ids in 'prompt' must be integers in [0, 2**31).", "prompt")
    if isinstance(raw, list) and len(raw) > 1:
        raise bad_request("batched prompts are not supported: send one prompt per request.", "prompt")
    raise bad_request("'prompt' must be a string (or a list of token ids).", "prompt")


def _parse_stop(raw: Any, limits: Limits) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw):
        raise bad_request("'stop' must be a non-empty string or a list of them.", "stop")
    if len(raw) > limits.max_stop_sequences:
        raise bad_request(f"at most {limits.max_stop_sequences} stop sequences are allowed.", "stop")
    if any(len(s) > limits.max_stop_chars for s in raw):
        raise bad_request(f"a stop sequence may be at most {limits.max_stop_chars} characters long.", "stop")
    return list(raw)


def _parse_max_tokens(body: dict[str, Any], endpoint: Endpoint, limits: Limits) -> int:
    key = "max_tokens"
    value = body.get("max_tokens")
    if endpoint is Endpoint.CHAT and body.get("max_completion_tokens") is not None:
        key, value = "max_completion_tokens", body["max_completion_tokens"]
    if value is None:
        return min(limits.default_max_tokens or limits.max_tokens_limit, limits.max_tokens_limit)
    if not _is_int(value):
        raise bad_request(f"'{key}' must be an integer.", key)
    if value < 1:
        raise bad_request(f"'{key}' must be at least 1, got {value}.", key)
    if value > limits.max_tokens_limit:
        raise bad_request(
            f"'{key}' is {value}, more than this server allows ({limits.max_tokens_limit}).", key
        )
    return value


def _parse_sampling(body: dict[str, Any], endpoint: Endpoint, limits: Limits) -> SamplingParams:
    s = SamplingParams(max_tokens=_parse_max_tokens(body, endpoint, limits))
    t = body.get("temperature")
    if t is not None:
        if not _is_number(t) or not 0 <= t <= 2:
            raise bad_request("'temperature' must be a number between 0 and 2.", "temperature")
        s.temperature = float(t)  # a tiny one (1e-300) is made greedy where it is used: the worker
    p = body.get("top_p")
    if p is not None:
        if not _is_number(p) or not 0 < p <= 1:
            raise bad_request("'top_p' must be a number in (0, 1].", "top_p")
        s.top_p = float(p)
    k = body.get("top_k")
    if k is not None:
        if not _is_int(k) or not top_k_valid(k) or k > INT_MAX:
            raise bad_request("'top_k' must be a positive integer, or -1 or 0 (off).", "top_k")
        s.top_k = k
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not INT_MIN <= seed <= INT_MAX:
            raise bad_request("'seed' must be a 64-bit integer.", "seed")
        s.seed = seed
    s.stop = _parse_stop(body.get("stop"), limits)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise bad_request("'ignore_eos' must be a boolean.", "ignore_eos")
        s.ignore_eos = ignore_eos
    parse_controls(body, endpoint, s)
    return s


def parse_request(body: Any, endpoint: Endpoint, limits: Limits) -> ParsedRequest:
    """Validate an OpenAI chat or completions body; raise RouterError(400) naming the bad parameter."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string.", "model")
    _check_fields(body, endpoint)
    req = ParsedRequest(endpoint=endpoint, model=model, sampling=_parse_sampling(body, endpoint, limits))
    req.n = _parse_n(body.get("n"))
    completion_key = endpoint is Endpoint.CHAT and body.get("max_completion_tokens") is not None
    req.max_tokens_given = body.get("max_tokens") is not None or completion_key
    request_budget.apply(req, "max_completion_tokens" if completion_key else "max_tokens", limits)
    if endpoint is Endpoint.CHAT:
        if "prompt" in body:
            raise bad_request("chat completions take 'messages', not 'prompt'.", "prompt")
        req.messages = parse_messages(body.get("messages"), limits)
    else:
        if "prompt" not in body:
            raise bad_request("'prompt' is required.", "prompt")
        req.prompt, req.prompt_token_ids = _parse_prompt(body["prompt"])
    if endpoint is Endpoint.CHAT:
        _chat_extras(req, body, limits)
    req.echo = echo_text(body, endpoint, req.messages, req.prompt)
    req.echo_ids = req.echo == "" and req.prompt_token_ids is not None
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    req.stream = stream
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object.", "stream_options")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
        inc = opts.get("include_usage", False)
        if not isinstance(inc, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean.", "stream_options")
        req.include_usage = inc
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string.", "user")
    req.user = user
    req.cache_salt = _parse_cache_salt(body.get("cache_salt"))
    return req


def _parse_cache_salt(salt: Any) -> str | None:
    """`cache_salt`: a non-empty string of at most MAX_CACHE_SALT_CHARS, as the workers check it."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters.",
                          "cache_salt")
    return salt


def check_model(requested: str, served: str | None) -> None:
    """404 model_not_found unless the client asked for the served model."""
    if served is None or requested != served:
        raise RouterError(
            404,
            f"The model {requested[:200]!r} does not exist. This server serves {served!r}.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def check_prompt_tokens(n: int, req: ParsedRequest, limits: Limits) -> None:
    """400 over the limit; the count is exact once the router (or else a worker) tokenized the prompt."""
    if limits.max_prompt_tokens is not None and n > limits.max_prompt_tokens:
        raise bad_request(
            f"The prompt has {n} tokens, more than this server allows ({limits.max_prompt_tokens}).",
            "messages" if req.endpoint is Endpoint.CHAT else "prompt",
            "context_length_exceeded",
        )
