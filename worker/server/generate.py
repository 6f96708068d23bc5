"""POST /internal/generate: a sequence streamed as NDJSON (START, TOKEN..., FINISH, ERROR or MIGRATE).

The engine admits the request (engine/async_engine.py: claimed, tokenized, a handoff's KV pulled
first, engine/kv_pull.py); this file parses and streams. Tokens given in generated_token_ids (a
handoff's first token, a resume's tokens so far) are replayed by the engine, never streamed: the
stream starts after them. A draining decode worker ends its streams with MIGRATE
(engine/migration.py): the sequence's KV lease, if any, and its tokens so far, for the router to
continue it elsewhere.
While nothing comes (queued, or a slow step) a HEARTBEAT
line goes out every `heartbeat_s`; if the engine thread has died or stalls meanwhile, the stream
ends with an ERROR instead (code engine_unhealthy), so the router resumes the request elsewhere.

Cheap per token: the outputs a lagging stream has accumulated go out in one write, and a token
line is encoded from a plain dict with one prebuilt JSON encoder.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from tandem.contracts.names import Role
from tandem.contracts.protocol import NDJSON, REQUEST_ID_HEADER, EventType, StreamEvent
from tandem.worker.engine.token_texts import TokenTexts
from tandem.worker.server.http_errors import refused
from tandem.worker.server.parsing import model_request
from tandem.worker.server.state import WorkerState

log = logging.getLogger("tandem.worker.server")

_encode = json.JSONEncoder(separators=(",", ":")).encode
_HEARTBEAT = b'{"type":"heartbeat"}\n'


def _line(ev: StreamEvent) -> bytes:
    return (_encode(ev.to_dict()) + "\n").encode()


def _token_line(token_ids: list[int], text: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
    """StreamEvent(TOKEN, token_ids, text).to_dict(), without building the dataclass per token."""
    doc: dict[str, Any] = {"type": "token", "token_ids": token_ids}
    if text:
        doc["text"] = text
    if logprobs:
        doc["logprobs"] = logprobs
    return (_encode(doc) + "\n").encode()


async def generate(request: web.Request) -> web.StreamResponse:
    from tandem.worker.engine.errors import RequestError

    parsed = await model_request(request, "/internal/generate", not_for=Role.PREFILL)
    if isinstance(parsed, web.Response):
        return parsed
    state, req = parsed
    try:
        outputs = await state.engine.generate(req)
    except RequestError as e:
        return refused(state, e, req.request_id)
    return await _stream(request, state, outputs, pulled=req.kv_source is not None)


async def _migrate_digests(state: WorkerState, outs: list[Any]) -> Any:
    """The digests of the KV a MIGRATE line among `outs` hands out (kv_pull.KVEndpoint.digests: off
    the loop, every rank's heads), or None."""
    out = next((o for o in outs if o.migrated and o.kv_blocks is not None), None)
    if out is None or state.engine.kv is None:
        return None
    return await state.engine.kv.digests(out.kv_blocks)


def _migrate_line(state: WorkerState, seq: Any, out: Any, digests: Any) -> bytes:
    """MIGRATE: where the sequence's leased KV is (none: it is recomputed), and its tokens so far."""
    kv = None
    if out.kv_blocks is not None:
        kv = state.engine.lease_source(seq.request_id, out.kv_blocks, seq.num_computed, digests)
    log.info("generate migrating", extra={"request_id": seq.request_id, "completion_tokens": len(seq.output_ids),
                                          "kv_tokens": kv.num_tokens if kv else 0})
    return _line(StreamEvent(EventType.MIGRATE, kv=kv, generated_token_ids=list(seq.output_ids)))


def _lines(state: WorkerState, seq: Any, outs: list[Any], digests: Any = None) -> tuple[list[bytes], bool]:
    """The NDJSON lines for a batch of outputs, and whether the stream ends with them."""
    lines = []
    for out in outs:
        if out.error is not None:
            lines.append(_line(StreamEvent(EventType.ERROR, error=out.error)))
            return lines, True
        if out.token_ids or out.text:
            lps = TokenTexts.of(state.engine.engine.tokenizer).wire(out.logprobs) if out.logprobs else None
            lines.append(_token_line(out.token_ids, out.text, lps))
        if out.migrated:
            lines.append(_migrate_line(state, seq, out, digests))
            return lines, True
        if out.finished:
            usage = {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output_ids),
                     "total_tokens": seq.num_tokens}
            lines.append(_line(StreamEvent(EventType.FINISH, finish_reason=out.finish_reason, usage=usage)))
            log.info("generate finished", extra={"request_id": seq.request_id,
                                                  "completion_tokens": len(seq.output_ids),
                                                  "finish_reason": str(out.finish_reason)})
            return lines, True
    return lines, False


async def _stream(request: web.Request, state: WorkerState, outputs: Any, pulled: bool) -> web.StreamResponse:
    """START, TOKEN lines (HEARTBEAT while there is none), then FINISH (or ERROR); a stream cut
    short aborts the sequence (closing `outputs` does)."""
    seq = outputs.seq
    rid = seq.request_id
    log.info("generate started", extra={"request_id": rid, "prompt_tokens": len(seq.prompt_ids),
                                         "pulled": pulled, "replayed": seq.num_resumed})
    state.open_streams += 1
    try:
        resp = web.StreamResponse(headers={"Content-Type": NDJSON, REQUEST_ID_HEADER: rid})
        await resp.prepare(request)
        await resp.write(_line(StreamEvent(EventType.START, prompt_tokens=len(seq.prompt_ids))))
        ended = False
        while not ended:
            outs = await outputs.get(state.settings.heartbeat_s)
            if outs:
                lines, ended = _lines(state, seq, outs, await _migrate_digests(state, outs))
                await resp.write(b"".join(lines))
            elif (problem := state.engine_problem()) is not None:
                log.error("ending a stream: %s", problem, extra={"request_id": rid})
                await resp.write(_line(StreamEvent(EventType.ERROR, error={
                    "message": f"this worker cannot finish the request: {problem}", "type": "internal_error",
                    "param": None, "code": "engine_unhealthy"})))
                ended = True
            else:
                await resp.write(_HEARTBEAT)
        await resp.write_eof()
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away; aborting", extra={"request_id": rid})
        raise
    finally:
        state.open_streams -= 1
        outputs.close()
