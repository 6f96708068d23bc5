"""The PULLING stage (request_state.py): a handoff's KV read from a peer's lease into blocks this
engine reserved, before the sequence waits for a seat.

The source (a prefill worker's result, or a draining decode worker's MIGRATE line) names its
leased blocks in a KVSource (`KVEndpoint.source`). The receiving engine checks the source, reserves
blocks and pulls the KV (of the prompt, or of prompt and generated tokens for a migrated sequence:
all but the last token) into them, all before the stream starts, so every failure is a plain
RequestError the router can act on (400 mismatch, 503 busy with Retry-After, 503 transfer failed),
and whatever failed leaves nothing allocated.

Every wait is bounded: blocks are awaited for `reserve_wait_s` (woken by each step that finishes
sequences and by every block freed outside one, no polling), the pull by the transport's own
timeout. A pulled sequence then queues for a seat like any other (scheduler.py: `ready`), so
max_num_seqs holds for handoffs too.

Why pull at once rather than when a seat frees: the prompt's KV is needed here anyway, and moving
it now frees the prefill worker's blocks at once (a decode backlog never fills the prefill pool,
and no lease can expire while it waits); when a seat frees, the sequence decodes in that very
step with no transfer in its way. The price is blocks held while it waits, which the queue bound
limits and which the scheduler takes back (the sequence is then recomputed locally) before it
would preempt a running stream. Leading blocks this engine's prefix cache already holds are taken
from it and only the rest is read from the lease (a subset of its blocks).

Every pull is verified (worker/kv/verify.py) once it landed and before the sequence waits for a
seat: the blocks it wrote must match the digests the source took as it handed them out. KV that
does not is never served: its blocks are freed unnamed and the prompt is prefilled here instead,
as a request without KV would be (the stream just starts later).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.contracts import timing
from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.kv_source import KVSource
from tandem.contracts.protocol import GenerateRequest
from tandem.worker.engine.errors import RequestError
from tandem.worker.engine.sequence import EngineSequence
from tandem.worker.kv.verify import Verdict, algorithm_for, block_digests, merge, verify

if TYPE_CHECKING:
    from tandem.worker.engine.engine import Engine
    from tandem.worker.kv.base import KVTransport

log = logging.getLogger("tandem.worker.engine")



Digests = tuple[str, int, list[int]]  # KVSource's digest_algorithm, digest_heads, block_digests
NO_DIGESTS: Digests = ("", 0, [])


@dataclass
class PullReport:
    """One pull that succeeded, for the worker's metrics."""

    seconds: float
    saved_bytes: int  # leading blocks found in this engine's prefix cache instead of pulled
    pulled_tokens: int
    migrated_from: str | None  # the draining decode worker's URL, or None for a prefill handoff
    verify: Verdict = Verdict.OFF  # FAILED: the KV was not used, the prompt is prefilled here instead
    verify_detail: str = ""  # why, unless VERIFIED
    verify_seconds: float = 0.0


@dataclass
class KVEndpoint:
    """This worker as a KV peer: its transport, and what the KVSources it hands out say about it."""

    transport: KVTransport
    url: str  # where peers reach its HTTP API
    engine_id: str
    kv_compat: str = ""
    reserve_wait_s: float = timing.KV_RESERVE_WAIT_S  # a handoff waits this long for blocks to receive its KV
    verify: bool = True  # digest the blocks handed out, check the blocks pulled (worker/kv/verify.py)
    on_verdict: Callable[[Verdict, float], None] = lambda verdict, seconds: None  # each pull's, for metrics

    async def digests(self, block_ids: list[int]) -> Digests:
        """The digests a KVSource of these blocks carries (worker/kv/verify.py): this rank's heads
        on a worker thread, a tensor-parallel worker's other ranks' from their rank servers; none
        with verification off."""
        from tandem.worker.kv.base import KVTransferError

        if not self.verify:
            return NO_DIGESTS
        t = self.transport
        algorithm = algorithm_for(t.pool)
        own = await asyncio.to_thread(block_digests, t.pool, block_ids, algorithm)
        try:
            others = await t.rank_digests(block_ids, algorithm)
        except KVTransferError as e:  # a rank that cannot answer fails the group soon; meanwhile say so
            log.error("KV handed out without digests (pullers cannot verify it): %s", e)
            return NO_DIGESTS
        parts = [(t.layout.kv_heads, own), *others]
        return algorithm, t.layout.num_kv_heads, merge(parts, t.layout.num_kv_heads, len(block_ids))

    def source(self, request_id: str, block_ids: list[int], num_tokens: int, lease_token: str,
               digests: Digests) -> KVSource:
        """Where a peer finds the KV of `num_tokens` tokens this worker leased in `block_ids`, with
        their `digests` (digests())."""
        t = self.transport
        algorithm, heads, values = digests
        return KVSource(url=self.url, engine_id=self.engine_id, backend=t.name, block_ids=block_ids,
                        num_tokens=num_tokens, lease_token=lease_token, extra=t.source_extra(),
                        ranks=t.source_ranks(), kv_compat=self.kv_compat, digest_algorithm=algorithm,
                        digest_heads=heads, block_digests=values)


def _mismatch(message: str, code: str | None = "kv_mismatch", param: str = "kv_source") -> RequestError:
    return RequestError(message, param=param, code=code)


def check_source(endpoint: KVEndpoint | None, src: KVSource, seq: EngineSequence, layout: KVLayout) -> None:
    """RequestError (400) when the KV source cannot belong to this request on this worker: it must
    come from a worker of this worker's kv_compat, over its backend, and hold the KV of every token
    but the last generated one (a handoff: the prompt). Checked before any block is reserved."""
    if not seq.output_ids:
        raise _mismatch("kv_source needs the tokens generated so far: generated_token_ids (a handoff: "
                        "the prefill worker's first token, or first_token_id)", None, "generated_token_ids")
    if endpoint is None:
        raise _mismatch("this worker has no KV transport (--kv-backend none)", "kv_backend_mismatch")
    if src.kv_compat != endpoint.kv_compat:
        raise _mismatch(f"kv_source holds KV of kv_compat {src.kv_compat!r}, this worker serves "
                        f"{endpoint.kv_compat!r}: its weights may differ, so that KV is not for it "
                        "(recompute the request here, or pull on a worker of that kv_compat)",
                        "kv_compat_mismatch")
    if src.backend != endpoint.transport.name:
        raise _mismatch(f"kv_source.backend is {src.backend!r}, this worker uses "
                        f"{endpoint.transport.name!r}", "kv_backend_mismatch")
    expected = seq.num_tokens - 1
    if src.num_tokens != expected or len(src.block_ids) != layout.blocks_for(expected):
        raise _mismatch(f"kv_source holds {src.num_tokens} tokens in {len(src.block_ids)} blocks, but "
                        f"prompt and generated tokens but the last are {expected} here: the workers "
                        "disagree on the tokenization")


async def pull(eng: Engine, endpoint: KVEndpoint, req: GenerateRequest, seq: EngineSequence,
               wait_for: Callable[[Callable[[], Any], float], Coroutine[Any, Any, Any]],
               blocks_freed: Callable[[], None]) -> PullReport:
    """Take `seq` (claimed) through PULLING: reserve blocks (waiting for them at most
    reserve_wait_s, with `wait_for`), read the KV into them, and queue it for a seat with its KV.
    Raises RequestError with nothing left allocated (503 busy when no blocks came, 503
    kv_transfer_failed when the read failed), except blocks a failed read may still write into:
    those stay out of use until it has stopped (then `blocks_freed()`)."""
    from tandem.worker.kv.base import KVTransferError

    rid, src = req.request_id, req.kv_source
    assert src is not None
    check_source(endpoint, src, seq, eng.layout)
    res = await wait_for(lambda: eng.begin_pull(seq), endpoint.reserve_wait_s)
    if res is None:
        raise RequestError("the KV cache is full: no blocks free to receive the prompt's KV", status=503,
                           type_="service_unavailable", code="kv_cache_full", retry_after_s=timing.WORKER_RETRY_AFTER_S)
    held = len(res.cached)
    missing = src.without_leading_blocks(held, eng.layout.block_size)
    t0 = time.monotonic()
    try:
        stats = await endpoint.transport.pull(rid, missing, res.fresh)
    except BaseException as e:
        _give_back(eng, seq, endpoint.transport.still_writing(rid), blocks_freed)
        if not isinstance(e, KVTransferError):
            raise
        log.warning("KV pull failed: %s", e, extra={"request_id": rid, "state": str(e.state)})
        raise RequestError(f"KV transfer from {src.url} failed ({e.state}): {e}", status=503,
                           type_="service_unavailable", code="kv_transfer_failed") from e
    verdict, detail, verify_s = await _verify(eng, endpoint, rid, missing, res.fresh)
    if verdict is Verdict.FAILED:
        eng.fail_pull(seq, requeue=True)  # its blocks freed unnamed: nothing may ever read that KV
        if seq.finished:  # aborted while it was pulled
            raise RequestError(f"the KV pulled from {src.url} failed verification ({detail}) and the request "
                               "was aborted meanwhile", status=503, type_="service_unavailable",
                               code="kv_transfer_failed")
    else:
        eng.finish_pull(seq)
    log.debug("KV pulled: %d bytes in %d transfers, %.1f ms", stats.bytes, stats.num_transfers,
              stats.seconds * 1e3, extra={"request_id": rid, "blocks": stats.num_blocks, "cached_blocks": held})
    if req.migrated_from is not None:
        log.info("migrated in: %d KV tokens pulled, %d cached here", missing.num_tokens,
                 src.num_tokens - missing.num_tokens, extra={"request_id": rid, "from": req.migrated_from})
    return PullReport(seconds=time.monotonic() - t0, saved_bytes=held * eng.layout.block_bytes,
                      pulled_tokens=missing.num_tokens, migrated_from=req.migrated_from, verify=verdict,
                      verify_detail=detail, verify_seconds=verify_s)


async def _verify(eng: Engine, endpoint: KVEndpoint, rid: str, src: KVSource,
                  blocks: list[int]) -> tuple[Verdict, str, float]:
    """The verdict on the blocks a pull of `src` wrote (worker/kv/verify.py), why unless VERIFIED,
    and the seconds it took (off the event loop: zlib and torch let go of the GIL)."""
    if not endpoint.verify:
        return Verdict.OFF, "", 0.0
    t0 = time.perf_counter()
    verdict, detail = await asyncio.to_thread(verify, eng.pool, eng.layout, src, blocks)
    for rank, (v, why) in enumerate(endpoint.transport.rank_verdicts(rid), start=1):  # theirs, as they pulled
        if v is Verdict.FAILED or (v is Verdict.SKIPPED and verdict is Verdict.VERIFIED):
            verdict, detail = v, f"rank {rank}: {why}"
    seconds = time.perf_counter() - t0
    endpoint.on_verdict(verdict, seconds)
    if verdict is Verdict.FAILED:
        log.error("KV pulled from %s failed verification, so it is not used: the prompt is prefilled here "
                  "instead (%s)", src.url, detail, extra={"request_id": rid})
    elif verdict is Verdict.SKIPPED:
        _once(f"KV pulls not verified: {detail}")
        log.debug("KV pull not verified: %s", detail, extra={"request_id": rid})
    return verdict, detail, seconds


_said: set[str] = set()


def _once(message: str) -> None:
    """A warning the first time it applies in this process (then tandem_kv_transfer_verify_skipped_total counts)."""
    if message not in _said:
        _said.add(message)
        log.warning("%s", message)


def _give_back(eng: Engine, seq: EngineSequence, landing: asyncio.Future | None, blocks_freed: Callable[[], None]) -> None:
    """PULLING -> FINISHED after a failed pull; blocks a READ may still write into (`landing`: the
    transport could not stop it in time) are freed only once it has stopped, never reused before."""
    if landing is None:
        eng.fail_pull(seq)
        return
    kept = eng.fail_pull(seq, keep_blocks=True)
    log.error("a failed KV read may still write into %d blocks: they stay out of use until it stops",
              len(kept), extra={"request_id": seq.request_id})

    def landed(_: asyncio.Future) -> None:
        eng.free_landed(kept)
        blocks_freed()

    landing.add_done_callback(landed)
