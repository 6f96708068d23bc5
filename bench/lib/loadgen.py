"""An asyncio load generator for any OpenAI-compatible server: streaming /v1/completions.

Open loop (requests sent at planned Poisson times, whatever the server's state) or closed loop
(a fixed number in flight). Records, per request, when every streamed chunk arrived, the usage
the server reported and the text, so TTFT, every inter-token gap, TPOT and end-to-end latency
follow (bench/lib/metrics.py). Greedy sampling (temperature 0) makes the text comparable across
arms.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.lib.metrics import RequestRecord
from bench.lib.workload import PlannedRequest, WorkloadSpec


def greedy_body(model: str, max_tokens: int, **prompt: Any) -> dict[str, Any]:
    """A streamed greedy OpenAI request of exactly max_tokens (`prompt=` or `messages=`): a
    random-weight model may sample EOS early, and every arm must produce the same length."""
    return {"model": model, **prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


def request_body(model: str, req: PlannedRequest) -> dict[str, Any]:
    return greedy_body(model, req.max_tokens, prompt=req.prompt)


async def stream_one(
    session: aiohttp.ClientSession, url: str, model: str, req: PlannedRequest, t0: float,
    timeout_s: float,
) -> RequestRecord:
    rec = RequestRecord(req.index, req.prompt_tokens_target, req.max_tokens, scheduled_s=req.at_s)
    return await stream_into(session, f"{url}/v1/completions", request_body(model, req), rec, t0, timeout_s)


NO_TOKEN = "stream ended without a token"


async def stream_into(session: aiohttp.ClientSession, endpoint: str, body: dict[str, Any], rec: RequestRecord,
                      t0: float, timeout_s: float, read_timeout_s: float | None = None) -> RequestRecord:
    """POST a streaming completion or chat completion and record its chunks into rec (a silence of
    read_timeout_s between chunks ends it with a TimeoutError)."""
    rec.send_s = time.perf_counter() - t0
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_read=read_timeout_s)
    try:
        async with session.post(endpoint, json=body, timeout=timeout) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    rec.done = True
                    break
                now = time.perf_counter() - t0
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    break
                # A token is what carries text: the router sends no empty deltas, and the last
                # chunk (finish_reason, empty text) is no token.
                text = chunk_text(obj)
                if text:
                    rec.chunk_times_s.append(now)
                    rec.text += text
                rec.finish_reason = finish_reason(obj) or rec.finish_reason
                usage = obj.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.completion_tokens = usage.get("completion_tokens")
    except TimeoutError as e:  # aiohttp's read timeouts are TimeoutErrors too; connect timeouts are not hangs
        rec.timed_out = not isinstance(e, aiohttp.ConnectionTimeoutError)
        rec.error = f"{type(e).__name__}: {e}"
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.end_s = time.perf_counter() - t0
    if rec.error is None and not rec.chunk_times_s:
        rec.error = NO_TOKEN
    return rec


def finish_reason(obj: dict[str, Any]) -> str | None:
    choices = obj.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


def chunk_text(obj: dict[str, Any]) -> str:
    """The text of a completions chunk (choices[0].text) or a chat chunk (choices[0].delta.content)."""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def run_open_loop(url: str, model: str, reqs: list[PlannedRequest],
                        timeout_s: float = 300.0) -> list[RequestRecord]:
    """Send each request at its planned time, regardless of how many are in flight."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        tasks = []
        for req in sorted(reqs, key=lambda r: r.at_s):
            delay = t0 + req.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(stream_one(session, url, model, req, t0, timeout_s)))
        records = await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.index)


async def run_closed_loop(url: str, model: str, reqs: list[PlannedRequest], concurrency: int,
                          timeout_s: float = 300.0) -> list[RequestRecord]:
    """Keep `concurrency` requests in flight until the list is exhausted."""
    pending = iter(reqs)  # shared by the clients: each request is taken by one
    records: list[RequestRecord] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()

        async def client() -> None:
            for req in pending:
                records.append(await stream_one(session, url, model, req, t0, timeout_s))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


async def run_workload(url: str, model: str, spec: WorkloadSpec, reqs: list[PlannedRequest],
                       timeout_s: float = 300.0) -> list[RequestRecord]:
    if spec.mode == "poisson":
        return await run_open_loop(url, model, reqs, timeout_s)
    return await run_closed_loop(url, model, reqs, spec.concurrency, timeout_s)


def token_counter(model_dir: str | Path):
    """count_tokens(text) with the served model's own tokenizer (BOS included, as the server counts)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda text: len(tok.encode(text).ids)
