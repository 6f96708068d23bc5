"""POST /tokenize and /detokenize, as vLLM serves them: the router's own copy of the workers'
tokenizer (tokenizer_sync.py) turns a prompt or chat messages into token ids and ids into text,
without a worker. 503 while the router has no tokenizer it trusts (not loaded, workers that
disagree, `--tokenizer off`); 400 naming the field for anything malformed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from tandem.router import request_gate
from tandem.router.errors import RouterError, bad_request
from tandem.router.sampling_fields import is_token_id
from tandem.router.tokenizer import ChatTemplateError, RouterTokenizer
from tandem.router.validation import Limits, parse_messages

INLINE_CHARS = 16_384  # larger inputs are encoded off the event loop
MAX_DETOKENIZE_IDS = 1 << 20


def _tokenizer(router: Any) -> RouterTokenizer:
    sync = router.tokens
    if sync is None or not sync.active or sync.tokenizer is None:
        raise RouterError(503, "this router has no tokenizer loaded yet (or its workers disagree); retry "
                          "shortly", "service_unavailable", None, "tokenizer_unavailable", {"Retry-After": "1"})
    return sync.tokenizer


async def _off_loop(size: int, fn: Any, *args: Any) -> Any:
    return fn(*args) if size <= INLINE_CHARS else await asyncio.to_thread(fn, *args)


async def tokenize(router: Any, body: Any, limits: Limits) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens"} for {"prompt"} or {"messages"} (chat template applied)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object.")
    tok = _tokenizer(router)
    try:
        if "messages" in body:
            messages = parse_messages(body["messages"], limits)
            size = sum(len(m["content"]) + 8 for m in messages)
            ids = await _off_loop(size, tok.encode_chat, messages)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("'prompt' (a string) or 'messages' is required.", "prompt")
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise bad_request("'add_special_tokens' must be a boolean.", "add_special_tokens")
            encode = tok.encode_prompt if add_special else tok.encode_plain
            ids = await _off_loop(len(prompt), encode, prompt)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    return {"count": len(ids), "max_model_len": router.workers.max_model_len() or 0, "tokens": ids}


async def detokenize(router: Any, body: Any) -> dict[str, Any]:
    """{"prompt": text} for {"tokens": [ids]}."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object.")
    tok = _tokenizer(router)
    ids = body.get("tokens")
    if not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE_IDS or not all(map(is_token_id, ids)):
        raise bad_request("'tokens' must be a list of token ids.", "tokens")
    vocab = tok.vocab_size()
    if any(t >= vocab for t in ids):
        raise bad_request(f"'tokens' must be below the vocabulary size ({vocab}).", "tokens")
    return {"prompt": await _off_loop(len(ids), tok.decode, ids)}


def add_routes(app: web.Application, router: Any) -> None:
    async def tokenize_route(request: web.Request) -> web.Response:
        router.check_auth(request.headers)
        body = await request_gate.read_body(request, router.config.max_body_bytes)
        check = body.get("model") if isinstance(body, dict) else None
        if check is not None:
            from tandem.router.validation import check_model

            check_model(str(check), router.workers.model())
        return web.json_response(await tokenize(router, body, router.limits))

    async def detokenize_route(request: web.Request) -> web.Response:
        router.check_auth(request.headers)
        body = await request_gate.read_body(request, router.config.max_body_bytes)
        return web.json_response(await detokenize(router, body))

    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)



