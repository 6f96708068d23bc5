"""The workers' own protocol as a benchmark speaks it, typed on tandem.contracts: a greedy request,
a prefill, the request that continues it on a decode worker (the KV handoff), and a stream's
timed events. The I/O is the router's WorkerClient for Tandem's runtime (HttpWorkerClient), so a
scenario that drives workers without a router sends exactly what the router sends.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import aiohttp
from tandem.contracts.protocol import EventType, GenerateRequest, PrefillResult, StreamEvent
from tandem.contracts.sampling import SamplingParams
from tandem.router.worker_client import HttpWorkerClient, Timeouts

# A benchmark's prompt may take minutes on a busy CPU (8k tokens, a tensor-parallel group).
BENCH_TIMEOUTS = Timeouts(prefill_s=1800.0, chunk_s=600.0)


def greedy(prompt_token_ids: list[int] | None = None, max_tokens: int = 16, *, prompt: str | None = None,
           request_id: str | None = None) -> GenerateRequest:
    """A greedy request that runs exactly max_tokens (EOS ignored): every arm does the same work."""
    return GenerateRequest(request_id=request_id or uuid.uuid4().hex, prompt=prompt, prompt_token_ids=prompt_token_ids,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def continued(request: GenerateRequest, prefilled: PrefillResult) -> GenerateRequest:
    """The decode worker's half of a handoff: pull the prefill worker's KV, replay its first token
    (whose text the client already has, so it is not streamed again)."""
    return dataclasses.replace(request, prompt_token_ids=prefilled.prompt_token_ids, prompt=None,
                               kv_source=prefilled.kv, generated_token_ids=[prefilled.first_token_id],
                               emitted_chars=len(prefilled.first_token_text))


@asynccontextmanager
async def worker_client() -> AsyncIterator[HttpWorkerClient]:
    """A client with its own session (no connection limit) and a benchmark's patience."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield HttpWorkerClient(session, BENCH_TIMEOUTS)


@dataclass
class Stream:
    """One /internal/generate stream: when it was sent and when each event arrived (perf_counter)."""

    sent_s: float
    events: list[tuple[float, StreamEvent]]

    @property
    def token_times(self) -> list[float]:
        """The arrival of every token (a line carrying several token ids counts each)."""
        return [t for t, e in self.events if e.type is EventType.TOKEN for _ in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for _, e in self.events if e.type is EventType.TOKEN)

    @property
    def started_s(self) -> float:
        """When its START line came: the decode worker holds the KV and has seated the sequence."""
        return next(t for t, e in self.events if e.type is EventType.START)


async def stream(client: HttpWorkerClient, url: str, request: GenerateRequest,
                 until: EventType | None = None) -> Stream:
    """Send the request to `url`'s /internal/generate and time its events to the end (or to the
    first `until` event); an ERROR event raises."""
    out = Stream(time.perf_counter(), [])
    async with aclosing(client.generate(url, request)) as events:
        async for ev in events:
            out.events.append((time.perf_counter(), ev))
            if ev.type is EventType.ERROR:
                raise RuntimeError(f"{url}: {request.request_id} failed: {ev.error}")
            if ev.type is until:
                break
    return out


async def handoff(client: HttpWorkerClient, prefill_url: str, decode_url: str, request: GenerateRequest,
                  until: EventType | None = None) -> tuple[PrefillResult, float, Stream]:
    """Prefill on one worker, then decode on another from its KV, as the router hands off: the
    prefill result, when it came back (perf_counter), and the decode stream."""
    prefilled = await client.prefill(prefill_url, request)
    done_s = time.perf_counter()
    return prefilled, done_s, await stream(client, decode_url, continued(request, prefilled), until)
