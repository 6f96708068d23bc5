"""The workers' own protocol as a benchmark speaks it, typed on tandem.contracts: a greedy request
and a stream's timed events. The I/O is the router's WorkerClient for Tandem's runtime (HttpWorkerClient), so a
scenario that drives workers without a router sends exactly what the router sends.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import aiohttp
from tandem.contracts.protocol import EventType, GenerateRequest, StreamEvent
from tandem.contracts.sampling import SamplingParams
from tandem.router.worker_client import HttpWorkerClient, Timeouts

# A benchmark's prompt may take minutes on a busy CPU (8k tokens, a tensor-parallel group).
BENCH_TIMEOUTS = Timeouts(prefill_s=1800.0, chunk_s=600.0)


def greedy(prompt_token_ids: list[int] | None = None, max_tokens: int = 16, *, prompt: str | None = None,
           request_id: str | None = None) -> GenerateRequest:
    """A greedy request that runs exactly max_tokens (EOS ignored): every arm does the same work."""
    return GenerateRequest(request_id=request_id or uuid.uuid4().hex, prompt=prompt, prompt_token_ids=prompt_token_ids,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


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
