"""The workers' request parsing: a body of the internal API is read strictly (contracts/json_body.py)
and every field of a GenerateRequest checked for its type before the engine sees it, so a malformed
call is a 4xx in OpenAI's format, never a 500 from deep inside the engine.

Ranges stay with the engine's own checks (engine/request_checks.py: finite numbers, a temperature
below 1e-5 taken as greedy, stop-string limits, token ids below the vocabulary, the context
length), so one rule serves every caller; here: types, the fields a KV handoff needs, and
unknown keys inside `sampling` and `kv_source` (a typo there would otherwise be silently ignored
or crash later).
Unknown top-level keys are ignored, so a newer router can talk to an older worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from aiohttp import web
from tandem.contracts.json_body import BodyError, decode_json
from tandem.contracts.kv_source import KVSource
from tandem.contracts.names import Role
from tandem.contracts.protocol import REQUEST_ID_HEADER, GenerateRequest, openai_error
from tandem.contracts.sampling import SamplingParams
from tandem.worker.server.http_errors import need_engine, wrong_role
from tandem.worker.server.state import STATE_KEY, WorkerState

MAX_REQUEST_ID_CHARS = 256


class RequestRefused(Exception):
    """A request refused while parsing; the error middleware answers with `response`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message)
        headers = {REQUEST_ID_HEADER: request_id} if request_id else None
        self.response = web.json_response(openai_error(message, "invalid_request_error", param, code),
                                          status=status, headers=headers)


def _valid_rid(rid: Any) -> bool:
    """A request id is printable ASCII (the router's are hex), it travels in headers, logs and KV frames."""
    return isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_CHARS and rid.isascii() and rid.isprintable()


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return _int(v) and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _ids(v: Any) -> bool:
    return isinstance(v, list) and all(_count(t) for t in v)


def _opt(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), str | None)


_SAMPLING: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (_int, "an integer"),
    "temperature": (_number, "a number"),
    "top_p": (_number, "a number"),
    "top_k": (_int, "an integer"),
    "seed": (_opt(_int), "an integer"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
             "a string or a list of strings"),
    "stop_token_ids": (_ids, "a list of token ids"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "min_p": (_number, "a number"),
    "min_tokens": (_int, "an integer"),
    "presence_penalty": (_number, "a number"),
    "frequency_penalty": (_number, "a number"),
    "repetition_penalty": (_number, "a number"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object of token id -> bias"),
    "logprobs": (_opt(_int), "an integer"),
    "structured": (_opt(lambda v: isinstance(v, dict)), "an object"),
    "forced_token_ids": (_ids, "a list of token ids"),
}
def _kv_rank(v: Any) -> bool:
    """One more rank of a tensor-parallel source (tandem.contracts.kv_source.KVRank)."""
    return (isinstance(v, dict) and set(v) <= {"url", "engine_id", "extra"} and isinstance(v.get("url"), str)
            and bool(v["url"]) and isinstance(v.get("engine_id"), str) and isinstance(v.get("extra", {}), dict))


_KV_SOURCE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "url": (lambda v: isinstance(v, str) and bool(v), "a URL"),
    "engine_id": (lambda v: isinstance(v, str), "a string"),
    "backend": (lambda v: isinstance(v, str), "a string"),
    "block_ids": (_ids, "a list of block ids"),
    "num_tokens": (_count, "a non-negative integer"),
    "extra": (lambda v: isinstance(v, dict), "an object"),
    "lease_token": (lambda v: isinstance(v, str), "a string"),
    "kv_compat": (lambda v: isinstance(v, str), "a string"),
    "ranks": (lambda v: isinstance(v, list) and all(map(_kv_rank, v)),
              "a list of objects with a url, an engine_id and an optional extra object"),
    "digest_algorithm": (lambda v: isinstance(v, str), "a string"),
    "digest_heads": (_count, "a non-negative integer"),
    "block_digests": (_ids, "a list of unsigned integers, one per block and KV head"),
}
_TOP: dict[str, tuple[Callable[[Any], bool], str]] = {
    "prompt": (_opt(lambda v: isinstance(v, str)), "a string"),
    "messages": (_opt(lambda v: isinstance(v, list) and all(map(_message, v))),
                 "a list of objects with a string role and content"),
    "prompt_token_ids": (_opt(_ids), "a list of token ids"),
    "sampling": (_opt(lambda v: isinstance(v, dict)), "an object"),
    "kv_source": (_opt(lambda v: isinstance(v, dict)), "an object"),
    "generated_token_ids": (_opt(_ids), "a list of token ids"),
    "emitted_chars": (_opt(_count), "a non-negative integer"),
    "first_token_id": (_opt(_count), "a token id"),
    "cache_salt": (_opt(lambda v: isinstance(v, str)), "a string"),
    "fairness_id": (_opt(lambda v: isinstance(v, str)), "a string"),
    "priority": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "chat_options": (_opt(lambda v: isinstance(v, dict)), "an object"),
}


def _check(obj: dict[str, Any], table: dict[str, tuple[Callable[[Any], bool], str]], where: str,
           rid: str, required: frozenset[str] = frozenset()) -> None:
    """Every key of `obj` known to `table` (when `where` is set) and of the right type."""
    if where:
        unknown = sorted(set(obj) - set(table))
        if unknown:
            raise RequestRefused(400, f"{where}: unknown field {unknown[0][:64]!r}; known: {sorted(table)}",
                                 where if where == "kv_source" else unknown[0][:64], "invalid_value", rid)
        missing = sorted(required - set(obj))
        if missing:
            raise RequestRefused(400, f"{where}: {missing[0]} is required", where, "invalid_value", rid)
    for key, (ok, what) in table.items():
        if key in obj and not ok(obj[key]):
            param = "kv_source" if where == "kv_source" else key
            raise RequestRefused(400, f"{where + '.' if where else ''}{key} must be {what}", param,
                                 "invalid_value", rid)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, read strictly; RequestRefused (4xx) for anything else."""
    rid = request.headers.get(REQUEST_ID_HEADER)
    rid = rid if _valid_rid(rid) else None
    raw = await request.read()  # over client_max_size: aiohttp's 413, formatted by the middleware
    try:
        body = decode_json(raw, request.headers.get("Content-Type"))
    except BodyError as e:
        raise RequestRefused(e.status, str(e), e.param, e.code, rid) from None
    if not isinstance(body, dict):
        raise RequestRefused(400, "the body must be a JSON object", request_id=rid)
    return body


def parse_generate(body: dict[str, Any], request: web.Request) -> GenerateRequest:
    """A GenerateRequest whose every field has its declared type (the engine checks the ranges)."""
    header_rid = request.headers.get(REQUEST_ID_HEADER)
    rid = body.get("request_id") or header_rid
    if not _valid_rid(rid):
        raise RequestRefused(400, f"request_id must be printable ASCII, 1 to {MAX_REQUEST_ID_CHARS} characters",
                             "request_id", request_id=header_rid if _valid_rid(header_rid) else None)
    _check(body, _TOP, "", rid)
    sampling = dict(body.get("sampling") or {})
    _check(sampling, _SAMPLING, "sampling", rid)
    kv = body.get("kv_source")
    if kv is not None:
        _check(kv, _KV_SOURCE, "kv_source", rid, frozenset({"url", "engine_id", "backend", "block_ids",
                                                             "num_tokens"}))
    known = {f.name for f in dataclasses.fields(GenerateRequest)}
    fields = {k: v for k, v in body.items() if k in known} | {"request_id": rid}
    fields["sampling"] = SamplingParams(**sampling)
    try:  # the KVSource checks what no single field shows (one digest per block)
        fields["kv_source"] = KVSource(**kv) if kv is not None else None
    except ValueError as e:
        raise RequestRefused(400, str(e), "kv_source", "invalid_value", rid) from None
    if fields.get("generated_token_ids") is None:
        fields["generated_token_ids"] = []
    return GenerateRequest(**fields)


async def request_id_body(request: web.Request, *, token: bool) -> tuple[str, str | None]:
    """(request_id, lease_token) of an abort or release call: the id from the body, else the
    header; the lease token is required when `token`, else optional."""
    body = await read_json(request)
    rid = body.get("request_id") or request.headers.get(REQUEST_ID_HEADER)
    if not _valid_rid(rid):
        raise RequestRefused(400, f"request_id must be printable ASCII, 1 to {MAX_REQUEST_ID_CHARS} characters",
                             "request_id")
    lease_token = body.get("lease_token")
    if (token or lease_token is not None) and (not isinstance(lease_token, str) or not lease_token):
        raise RequestRefused(400, "lease_token must be the KVSource's lease_token (a non-empty string)",
                             "lease_token", "invalid_value", rid)
    return rid, lease_token


async def model_request(request: web.Request, route: str, not_for: Role
                        ) -> tuple[WorkerState, GenerateRequest] | web.Response:
    """The start of /internal/generate and /internal/prefill: parse the body and check this worker
    takes the route (not a `not_for` worker, an engine that is up); the engine does the rest."""
    state = request.app[STATE_KEY]
    req = parse_generate(await read_json(request), request)
    rid = req.request_id
    if state.settings.role == not_for:
        return wrong_role(state, route, rid)
    if (resp := need_engine(state, rid)) is not None:
        return resp
    return state, req
