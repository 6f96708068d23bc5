"""One handoff parity probe: a seeded prompt through the decode worker alone, then through a prefill
worker and the same decode worker (the KV pulled over the real transport), both teacher-forced
through a seeded continuation with its log probabilities returned; router/parity/decisions.py compares them.

Both paths score each continuation token the same way where it matters: the prompt in one prefill
chunk, then one decode step per token, so with the same weights and a faithful handoff the numbers
agree to the last bit in float32 (a batch shared with other requests can move the last bits). The
prompt is new per probe and each path runs under a prefix-cache salt of its own (`cache_salt`), so
neither path, nor any client request, finds the other's KV in a prefix cache: the decode worker
alone computes the prompt from scratch, and the handoff pulls every block of it. (A worker older
than the salt ignores it: it then keeps the prompt's full blocks from its own pass, which runs
first, and pulls the rest, always the last block.) Everything a failed probe leaves on a worker (a
lease, a sequence) is aborted.

A runtime whose generate cannot be forced through given tokens (vLLM: `forces_tokens` False) is
probed the other way round: the handoff path generates the continuation greedily, with the log
probability of each token it chose, and the decode worker alone then scores exactly those tokens,
teacher-forced, as part of a prompt (`WorkerClient.score`: vLLM's `prompt_logprobs`). The alone
path computes them in one forward pass instead of one decode step each, so its numbers are the
same only up to the kernels' rounding, which the dtype's tolerance covers.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Sequence

from tandem.contracts.handoff_parity import ProbeOutcome, ProbeResult
from tandem.contracts.protocol import EventType, GenerateRequest
from tandem.contracts.sampling import LOGPROB_FLOOR, SamplingParams
from tandem.router.errors import RouterError
from tandem.router.parity.decisions import Pair, Scored, compare, probe_tokens
from tandem.router.worker_client import HandoffDiverged, WorkerClient, WorkerFailed, describe


def _sampling(continuation: Sequence[int], forced: bool) -> SamplingParams:
    return SamplingParams(max_tokens=len(continuation), temperature=0.0, ignore_eos=True, logprobs=0,
                          forced_token_ids=list(continuation) if forced else None)


def _request(request_id: str, prompt: Sequence[int], continuation: Sequence[int], salt: str, forced: bool = True,
             **handoff: object) -> GenerateRequest:
    return GenerateRequest(request_id, prompt_token_ids=list(prompt), sampling=_sampling(continuation, forced),
                           cache_salt=salt, **handoff)


def _scored(entry: object) -> Scored:
    if not isinstance(entry, dict):
        raise ValueError("a token without logprobs")
    return Scored(int(entry["id"]), max(float(entry["logprob"]), LOGPROB_FLOOR))


async def _stream(client: WorkerClient, url: str, req: GenerateRequest) -> list[Scored]:
    """Every token line's scored tokens, until the stream's finish."""
    out: list[Scored] = []
    async for ev in client.generate(url, req):
        if ev.type is EventType.TOKEN:
            out.extend(_scored(e) for e in ev.logprobs or [None] * len(ev.token_ids))
        elif ev.type is EventType.ERROR:
            raise WorkerFailed(f"generate on {url}: {(ev.error or {}).get('message')}", dead=False)
        elif ev.type is EventType.FINISH:
            return out
        elif ev.type is EventType.MIGRATE:
            raise WorkerFailed(f"generate on {url}: the worker is leaving", dead=False)
    raise WorkerFailed(f"generate on {url}: the stream ended without a finish", dead=False)


async def _handoff(client: WorkerClient, pair: Pair, rid: str, prompt: Sequence[int],
                   continuation: Sequence[int], forced: bool = True) -> list[Scored]:
    """Prefill on the prefill worker, then decode with its KV pulled (forced through `continuation`,
    or greedy for as many tokens); the lease freed on any failure."""
    salt = f"parity-probe-{rid}"
    res = await client.prefill(pair.prefill.url, _request(rid, prompt, continuation, salt, forced))
    if res.kv is None:
        raise WorkerFailed(f"prefill on {pair.prefill.url} handed off no KV ({res.finish_reason})", dead=False)
    first = _scored(res.first_token_logprobs)
    pulled = False
    try:
        req = _request(rid, prompt, continuation, salt, forced, kv_source=res.kv,
                       generated_token_ids=[res.first_token_id])
        rest = await _stream(client, pair.decode.url, req)
        pulled = True
        return [first, *rest]
    finally:
        if not pulled:
            await asyncio.gather(client.abort(pair.prefill.url, rid, res.kv.lease_token),
                                 client.abort(pair.decode.url, rid))


async def _alone(client: WorkerClient, url: str, rid: str, prompt: Sequence[int],
                 continuation: Sequence[int]) -> list[Scored]:
    done = False
    try:
        out = await _stream(client, url, _request(rid, prompt, continuation, f"parity-probe-{rid}"))
        done = True
        return out
    finally:
        if not done:
            await client.abort(url, rid)


async def _scored_pair(client: WorkerClient, pair: Pair, tag: str, prompt: Sequence[int], n: int
                       ) -> tuple[list[Scored], list[Scored]]:
    """(handoff, alone) for a runtime without forcing: the handoff's greedy tokens, then the decode
    worker alone scoring those very tokens after the prompt."""
    handoff = await _handoff(client, pair, f"parity-{tag}-handoff", prompt, [0] * n, forced=False)
    chosen = [s.token_id for s in handoff]
    rid = f"parity-{tag}-alone"
    alone = await client.score(pair.decode.url, rid, [*prompt, *chosen], len(chosen), f"parity-probe-{rid}")
    return handoff, [Scored(t, max(lp, LOGPROB_FLOOR)) for t, lp in alone]


async def run_probe(client: WorkerClient, pair: Pair, tolerance: float, timeout_s: float,
                    seed: int | None = None) -> ProbeResult:
    """Probe `pair` within `timeout_s`; never raises for what the workers do (an ERROR result)."""
    t0, at = time.monotonic(), time.time()
    tag = uuid.uuid4().hex[:16]
    seed = int(tag, 16) if seed is None else seed
    prompt, continuation = probe_tokens(seed)
    result = ProbeResult(pair.prefill.url, pair.decode.url, pair.decode.kv_compat, ProbeOutcome.ERROR,
                         tolerance=tolerance, dtype=pair.decode.dtype, tokens=len(continuation), at_unix=at,
                         seed=seed)
    try:
        async with asyncio.timeout(timeout_s):
            if getattr(client, "forces_tokens", True):
                alone = await _alone(client, pair.decode.url, f"parity-{tag}-alone", prompt, continuation)
                handoff = await _handoff(client, pair, f"parity-{tag}-handoff", prompt, continuation)
            else:
                handoff, alone = await _scored_pair(client, pair, tag, prompt, len(continuation))
                continuation = [s.token_id for s in handoff]
        result.outcome, result.max_abs_diff, result.message = compare(handoff, alone, tolerance, continuation)
    except HandoffDiverged as e:  # no logprob to compare: the tokens themselves differ
        result.outcome, result.max_abs_diff = ProbeOutcome.MISMATCH, math.inf
        result.message = f"the handoff's tokens differ: {e}"
    except TimeoutError:
        result.message = f"the probe took longer than {timeout_s:g} s"
    except (WorkerFailed, RouterError) as e:
        result.message = str(e)
    except (ValueError, KeyError, TypeError) as e:
        result.message = f"a worker answered the probe with something unreadable: {describe(e)}"
    result.seconds = time.monotonic() - t0
    return result
