"""The sampling controls beyond temperature/top-k/top-p, logprobs, and structured output, read
from an OpenAI body into SamplingParams (validation.py calls these). Pure; each bad value is a 400
naming its field. Ranges follow OpenAI (penalties in [-2, 2], logit_bias in [-100, 100], at most
20 top logprobs) and vLLM (repetition_penalty > 0, min_p in [0, 1], min_tokens <= max_tokens)."""

from __future__ import annotations

import math
from typing import Any

from tandem.contracts.json_body import BodyError, decode_document
from tandem.contracts.sampling import LOGIT_BIAS_RANGE, MAX_TOP_LOGPROBS, SamplingParams
from tandem.router.errors import bad_request
from tandem.router.openai_schema import Endpoint

MAX_LOGIT_BIAS = 1024
MAX_TOKEN_ID = 2**31 - 1  # token ids the router accepts; the worker checks them against its vocabulary
MAX_STOP_TOKEN_IDS = 64


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_token_id(v: Any) -> bool:
    return is_int(v) and 0 <= v <= MAX_TOKEN_ID


def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not is_number(v) or v > hi or v < lo or (lo_open and v == lo):
        raise bad_request(f"'{key}' must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}].", key)
    return float(v)


def _logit_bias(raw: Any) -> dict[str, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to biases.", "logit_bias")
    lo, hi = LOGIT_BIAS_RANGE
    out: dict[str, float] = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 10 and int(k) <= MAX_TOKEN_ID):
            raise bad_request("'logit_bias' keys must be token ids (as strings).", "logit_bias")
        if not is_number(v) or not lo <= v <= hi:
            raise bad_request(f"'logit_bias' values must be numbers in [{lo:g}, {hi:g}].", "logit_bias")
        out[str(int(k))] = float(v)
    return out


def _logprobs(body: dict[str, Any], endpoint: Endpoint) -> int | None:
    """How many alternatives to report per token (0: the chosen token's only); None: no logprobs."""
    lp = body.get("logprobs")
    if endpoint is Endpoint.COMPLETION:
        if lp is None:
            return None
        if not is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}].", "logprobs")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise bad_request("'logprobs' must be a boolean (top_logprobs says how many alternatives).", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad_request(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}].", "top_logprobs")
    if not lp:
        if top:
            raise bad_request("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        return None
    return top or 0


def _stop_token_ids(raw: Any) -> list[int]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_STOP_TOKEN_IDS or not all(map(is_token_id, raw)):
        raise bad_request(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids.",
                          "stop_token_ids")
    return list(raw)


def parse_controls(body: dict[str, Any], endpoint: Endpoint, s: SamplingParams) -> None:
    """Fill the controls into `s` (max_tokens already set)."""
    s.presence_penalty = _number(body, "presence_penalty", -2, 2, 0.0)
    s.frequency_penalty = _number(body, "frequency_penalty", -2, 2, 0.0)
    s.repetition_penalty = _number(body, "repetition_penalty", 0, 10, 1.0, lo_open=True)
    s.min_p = _number(body, "min_p", 0, 1, 0.0)
    mt = body.get("min_tokens")
    if mt is not None:
        if not is_int(mt) or not 0 <= mt <= s.max_tokens:
            raise bad_request("'min_tokens' must be an integer between 0 and max_tokens.", "min_tokens")
        s.min_tokens = mt
    s.logit_bias = _logit_bias(body.get("logit_bias"))
    s.stop_token_ids = _stop_token_ids(body.get("stop_token_ids"))
    s.logprobs = _logprobs(body, endpoint)
    s.structured = structured_spec(body)


def _response_format(rf: Any) -> dict[str, Any] | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'.", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema", {}) if isinstance(js, dict) else None
        if not isinstance(schema, dict | bool):
            raise bad_request("response_format json_schema needs {'json_schema': {'name', 'schema': {...}}}.",
                              "response_format")
        return {"json_schema": schema}
    raise bad_request(f"response_format type {kind[:40]!r} is not supported (text, json_object, json_schema).",
                      "response_format")


_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark",
               "json_object": "json_object"}
_VLLM_HINTS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


def _vllm_spec(so: Any, param: str) -> dict[str, Any]:
    """vLLM's structured_outputs object: one of json, regex, choice, grammar, json_object."""
    if not isinstance(so, dict):
        raise bad_request(f"'{param}' must be an object.", param)
    extra = [k for k in so if k not in _VLLM_KINDS and k not in _VLLM_HINTS and so[k] is not None]
    if extra:
        raise bad_request(f"'{param}.{extra[0][:40]}' is not supported by this server.", param)
    kinds = [k for k in _VLLM_KINDS if so.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad_request(f"'{param}' needs exactly one of {', '.join(_VLLM_KINDS)}.", param)
    value = so[kinds[0]]
    if kinds[0] == "json" and isinstance(value, str):
        try:
            value = decode_document(value, param, f"the JSON schema in '{param}'")
        except BodyError as e:
            raise bad_request(str(e), param, e.code) from None
    return {_VLLM_KINDS[kinds[0]]: value if kinds[0] != "json_object" else True}


def structured_spec(body: dict[str, Any]) -> dict[str, Any] | None:
    """The grammar spec (tandem.contracts.structured_output) from whichever field asks, checked to
    compile; a 400 naming the field otherwise. At most one field may ask."""
    given: list[tuple[str, dict[str, Any] | None]] = []
    if body.get("response_format") is not None:
        given.append(("response_format", _response_format(body["response_format"])))
    if body.get("structured_outputs") is not None:
        given.append(("structured_outputs", _vllm_spec(body["structured_outputs"], "structured_outputs")))
    for key, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if body.get(key) is not None:
            given.append((key, _vllm_spec({kind: body[key]}, key)))
    asking = [(k, spec) for k, spec in given if spec is not None]
    if len(asking) > 1:
        raise bad_request(f"only one of {', '.join(k for k, _ in asking)} may constrain the output.", asking[1][0])
    if not asking:
        return None
    key, spec = asking[0]
    _check_grammar(spec, key)
    return spec


def _check_grammar(spec: dict[str, Any], param: str) -> None:
    try:
        from tandem.contracts.structured_output import StructuredOutputError, validate
    except ImportError:  # pragma: no cover - the router extra installs llguidance; workers check too
        return
    try:
        validate(spec)
    except StructuredOutputError as e:
        raise bad_request(f"'{param}': {e}", param) from None
    except ImportError:  # llguidance missing: the workers check it
        return
