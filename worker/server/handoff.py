"""Both ends of a KV handoff. The source (a prefill worker's result, or a draining decode worker's
MIGRATE line) names its leased blocks in a KVSource (`leased_source`). The receiving decode worker
checks the source, takes a place in the queue, reserves blocks and pulls the KV (of the prompt, or
of prompt and generated tokens for a migrated sequence: all but the last token) into them, all
before the stream starts, so that every failure is a plain answer the router can act on (400
mismatch, 409 duplicate, 429 queue full, 503 busy with Retry-After, 503 transfer failed).

Every wait is bounded: blocks are awaited for `reserve_wait_s` (woken by each step that finishes
sequences, no polling), the pull by the transport's own timeout. A pulled sequence then queues
for a seat like any other (engine/scheduler.py: `ready`), so max_num_seqs holds for handoffs too.

Why pull at once rather than when a seat frees: the prompt's KV is needed here anyway, and moving
it now frees the prefill worker's blocks at once (a decode backlog never fills the prefill pool,
and no lease can expire while it waits); when a seat frees, the sequence decodes in that very
step with no transfer in its way, so its first gap is an ordinary one. The price is blocks held
while it waits, which the queue bound limits and which the scheduler takes back (the sequence is
then recomputed locally) before it would preempt a running stream.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from aiohttp import web
from tandem.contracts.protocol import GenerateRequest, KVSource
from tandem.worker.server.responses import busy_response, error_response
from tandem.worker.server.state import WorkerState

log = logging.getLogger("tandem.worker.server")


def leased_source(state: WorkerState, request_id: str, block_ids: list[int], num_tokens: int) -> KVSource | None:
    """Where a peer finds the KV of `num_tokens` tokens this worker leased in `block_ids`, with the
    lease's token; None when the lease has ended already (expired before it was handed out)."""
    token = state.engine.engine.lease_token(request_id)
    if token is None or state.transport is None:
        return None
    t = state.transport
    return KVSource(url=state.settings.advertise_url, engine_id=state.settings.engine_id, backend=t.name,
                    block_ids=block_ids, num_tokens=num_tokens, lease_token=token, extra=t.source_extra(),
                    ranks=t.source_ranks())


def check_source(state: WorkerState, req: GenerateRequest, seq: Any) -> web.Response | None:
    """A 400 when the KV source cannot belong to this request on this worker: it must hold the KV
    of every token but the last generated one (a handoff: the prompt, then the first token)."""
    rid, src, eng = req.request_id, req.kv_source, state.engine.engine
    if not seq.output_ids:
        return error_response(400, "kv_source needs the tokens generated so far: generated_token_ids "
                              "(a handoff: the prefill worker's first token, or first_token_id)",
                              param="generated_token_ids", request_id=rid)
    if state.transport is None:
        return error_response(400, "this worker has no KV transport (--kv-backend none)", param="kv_source",
                              code="kv_backend_mismatch", request_id=rid)
    if src.backend != state.transport.name:
        return error_response(400, f"kv_source.backend is {src.backend!r}, this worker uses "
                              f"{state.transport.name!r}", param="kv_source", code="kv_backend_mismatch",
                              request_id=rid)
    expected = seq.num_tokens - 1
    if src.num_tokens != expected or len(src.block_ids) != eng.layout.blocks_for(expected):
        return error_response(400, f"kv_source holds {src.num_tokens} tokens in {len(src.block_ids)} blocks, "
                              f"but prompt and generated tokens but the last are {expected} here: the "
                              "workers disagree on the tokenization", param="kv_source", code="kv_mismatch",
                              request_id=rid)
    return None


async def pull(state: WorkerState, req: GenerateRequest, seq: Any) -> list[int] | web.Response:
    """Reserve blocks and pull the KV into them (the request's claim is held by the caller); the
    blocks, or an error response with nothing left allocated. Leading blocks this worker's prefix
    cache already holds are taken from it, and only the rest is read from the source's lease (a
    subset of its blocks)."""
    from tandem.worker.kv.base import KVTransferError

    rid, src, aeng = req.request_id, req.kv_source, state.engine
    eng = aeng.engine
    res = await aeng.wait_for(lambda: eng.reserve_for_pull(seq), state.settings.reserve_wait_s)
    if res is None:
        state.metrics.refused.labels("kv_cache_full").inc()
        return busy_response(503, "the KV cache is full: no blocks free to receive the prompt's KV",
                             "kv_cache_full", rid)
    held = len(res.cached)
    missing = dataclasses.replace(src, block_ids=src.block_ids[held:],
                                  num_tokens=src.num_tokens - held * eng.layout.block_size)
    t0 = time.monotonic()
    try:
        stats = await state.transport.pull(rid, missing, res.fresh)
    except KVTransferError as e:
        eng.free_blocks(res.blocks)
        log.warning("KV pull failed: %s", e, extra={"request_id": rid, "state": str(e.state)})
        return error_response(503, f"KV transfer from {src.url} failed ({e.state}): {e}", "service_unavailable",
                              code="kv_transfer_failed", request_id=rid)
    except BaseException:
        eng.free_blocks(res.blocks)
        raise
    state.metrics.kv_pull_seconds.observe(time.monotonic() - t0)
    state.metrics.kv_pull_saved_bytes.inc(held * eng.layout.block_bytes)
    log.debug("KV pulled: %d bytes in %d transfers, %.1f ms", stats.bytes, stats.num_transfers,
              stats.seconds * 1e3, extra={"request_id": rid, "blocks": stats.num_blocks, "cached_blocks": held})
    if req.migrated_from is not None:
        state.metrics.migrations_in.inc()
        state.metrics.migration_pulled_tokens.inc(missing.num_tokens)
        log.info("migrated in: %d KV tokens pulled, %d cached here", missing.num_tokens,
                 src.num_tokens - missing.num_tokens, extra={"request_id": rid, "from": req.migrated_from})
    return res.blocks
