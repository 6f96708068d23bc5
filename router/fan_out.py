"""`n` > 1: one client request as n sequences, fanned out above the orchestrator.

The request's parent record (`ClientRequest`, journey.py) owns one journey per choice. Choice 0
starts alone; the others start once its prompt has been computed (its first event), so they find
the prompt's KV in the prefix cache of the worker that computed it (the prefix-aware policy sends
them there) instead of computing it n times. Each choice is a request of its own to the workers
(id `<request id>-<i>`, its own seed: the client's seed + i modulo 2**64, so a seeded request is
reproducible, its choices differ and every seed stays one a worker takes); their events come back
merged, tagged with the choice index. A consumer that stops early closes every choice, which
aborts them on every worker they touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from tandem.contracts.json_body import INT_MAX
from tandem.router.journey import ClientRequest, Event
from tandem.router.orchestrator import Orchestrator
from tandem.router.validation import ParsedRequest


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed: seed + i, wrapped past the largest 64-bit seed (2**64 - 1 + 1 is 0), as the
    workers' generators take a seed modulo 2**64 anyway."""
    return seed + i if seed + i <= INT_MAX else seed + i - 2**64


def _choice(parsed: ParsedRequest, i: int) -> ParsedRequest:
    if i == 0:
        return parsed
    seed = parsed.sampling.seed
    sampling = dataclasses.replace(parsed.sampling, seed=None if seed is None else choice_seed(seed, i))
    return dataclasses.replace(parsed, sampling=sampling)


async def choices(orchestrator: Orchestrator, parsed: ParsedRequest, record: ClientRequest
                  ) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) for every choice, in the order they happen."""
    journeys = record.fan_out(parsed.n)
    if parsed.n == 1:
        async with contextlib.aclosing(orchestrator.run(parsed, journeys[0])) as events:
            async for ev in events:
                yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()
    first_event = asyncio.Event()

    async def pump(i: int) -> None:
        if i:
            await first_event.wait()
        try:
            async with contextlib.aclosing(orchestrator.run(_choice(parsed, i), journeys[i])) as events:
                async for ev in events:
                    first_event.set()
                    await queue.put((i, ev))
            await queue.put((i, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            first_event.set()
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i)) for i in range(parsed.n)]
    try:
        done = 0
        while done < parsed.n:
            i, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
