"""An in-process WorkerClient for the router's request state machine: scripted answers per worker,
every call and abort recorded, no processes and no sockets (tests run in milliseconds).

A worker failure is scripted as the exception the real client raises: `fail(status, body)` goes
through `worker_client.classify`, exactly as an HTTP answer of that status would.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from tandem.contracts.kv_source import KVSource
from tandem.contracts.names import Role
from tandem.contracts.protocol import (
    EventType,
    FinishReason,
    GenerateRequest,
    PrefillResult,
    StreamEvent,
    WorkerInfo,
)
from tandem.router.worker_client import WorkerFailed, classify

Outcome = PrefillResult | Exception
StreamItem = StreamEvent | Exception | asyncio.Event  # an Event: the stream waits for it there


def fail(status: int, code: str | None = None, param: str | None = None, type_: str = "invalid_request_error",
         message: str = "scripted failure", retry_after: str | None = None) -> Exception:
    """What the real client raises for a worker's answer with this status, OpenAI error body and
    Retry-After header."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return classify(status, body, "scripted call", retry_after)


def busy(status: int = 429, retry_after: str | None = "1") -> Exception:
    """A full worker's refusal (429, or 503 with Retry-After)."""
    return fail(status, "server_overloaded", type_="service_unavailable", message="queue full",
                retry_after=retry_after)


def died(message: str = "connection reset") -> WorkerFailed:
    """A worker that went away (connection refused or cut, a timeout)."""
    return WorkerFailed(message, dead=True)


def start(prompt_tokens: int) -> StreamEvent:
    return StreamEvent(EventType.START, prompt_tokens=prompt_tokens)


def token(token_id: int, text: str) -> StreamEvent:
    return StreamEvent(EventType.TOKEN, token_ids=[token_id], text=text)


def finish(reason: FinishReason = FinishReason.STOP) -> StreamEvent:
    return StreamEvent(EventType.FINISH, finish_reason=reason)


def migrate(url: str, generated: list[int], num_tokens: int, with_kv: bool = True) -> StreamEvent:
    """A draining decode worker's last line: the sequence's KV leased at `url` (num_tokens: prompt
    and generated tokens but the last), or none."""
    kv = KVSource(url, url + "-1", "tcp", [0], num_tokens, lease_token=f"token-of-{url}") if with_kv else None
    return StreamEvent(EventType.MIGRATE, kv=kv, generated_token_ids=list(generated))


def prefilled(url: str, prompt_ids: list[int], first: int, text: str,
              finish_reason: FinishReason | None = None) -> PrefillResult:
    """A prefill worker's success: the first token and (unless it finished) the KV to pull."""
    kv = None if finish_reason else KVSource(url, "e-1", "tcp", [0], len(prompt_ids),
                                             lease_token=f"token-of-{url}")
    return PrefillResult("rid", list(prompt_ids), first, text, finish_reason, kv)


@dataclass
class Call:
    kind: str  # "prefill" | "generate"
    url: str
    request: GenerateRequest


@dataclass
class FakeWorkers:
    """WorkerClient with scripted workers; each prefill/generate call takes the next scripted answer."""

    infos: dict[str, WorkerInfo] = field(default_factory=dict)
    prefills: dict[str, list[Outcome]] = field(default_factory=lambda: defaultdict(list))
    streams: dict[str, list[list[StreamItem]]] = field(default_factory=lambda: defaultdict(list))
    calls: list[Call] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)
    abort_tokens: list[str | None] = field(default_factory=list)  # the lease token each abort carried
    # url -> (set when a stream there is being closed, what the closing waits for)
    close_gates: dict[str, tuple[asyncio.Event, asyncio.Event]] = field(default_factory=dict)
    forces_tokens: bool = True  # False: a runtime like vLLM's, which the parity probe asks to `score`
    scores: dict[str, list[list[float] | Exception]] = field(default_factory=lambda: defaultdict(list))
    scored: list[tuple[str, list[int], int, str]] = field(default_factory=list)  # (url, token_ids, n, salt)

    def add(self, url: str, role: Role, kv_compat: str = "g1") -> str:
        self.infos[url] = WorkerInfo(role=role, model="toy", max_model_len=4096, engine_id=url + "-1",
                                     kv_compat=kv_compat, kv_backend="tcp", ready=True, running=0,
                                     waiting=0, kv_usage=0.0, outstanding_prompt_tokens=0)
        return url

    def on_prefill(self, url: str, *outcomes: Outcome) -> None:
        self.prefills[url].extend(outcomes)

    def on_generate(self, url: str, *streams: list[StreamItem]) -> None:
        self.streams[url].extend(streams)

    def on_score(self, url: str, *outcomes: list[float] | Exception) -> None:
        """The logprobs each next `score` call there returns (for its last n tokens), or raises."""
        self.scores[url].extend(outcomes)

    def slow_close(self, url: str) -> tuple[asyncio.Event, asyncio.Event]:
        """Make closing a stream from `url` take time, as a real connection's may: returns (entered,
        release): `entered` is set once a close is under way, which then waits for `release`."""
        gate = self.close_gates[url] = (asyncio.Event(), asyncio.Event())
        return gate

    def made(self, kind: str) -> list[Call]:
        return [c for c in self.calls if c.kind == kind]

    async def info(self, url: str, role: Role | None = None) -> WorkerInfo:
        if url not in self.infos:
            raise died(f"{url} is not a scripted worker")
        return self.infos[url]

    async def prefill(self, url: str, request: GenerateRequest) -> PrefillResult:
        self.calls.append(Call("prefill", url, request))
        if not self.prefills[url]:
            raise died(f"no prefill scripted for {url}")
        outcome = self.prefills[url].pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def generate(self, url: str, request: GenerateRequest) -> AsyncGenerator[StreamEvent, None]:
        self.calls.append(Call("generate", url, request))
        if not self.streams[url]:
            raise died(f"no stream scripted for {url}")
        try:
            for item in self.streams[url].pop(0):
                if isinstance(item, asyncio.Event):
                    await item.wait()
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            if url in self.close_gates:
                entered, release = self.close_gates[url]
                entered.set()
                await release.wait()

    async def score(self, url: str, request_id: str, token_ids: list[int], n: int, cache_salt: str
                    ) -> list[tuple[int, float]]:
        self.scored.append((url, list(token_ids), n, cache_salt))
        if not self.scores[url]:
            raise died(f"no score scripted for {url}")
        outcome = self.scores[url].pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return list(zip(token_ids[-n:], outcome, strict=True))

    async def abort(self, url: str, request_id: str, lease_token: str | None = None) -> None:
        self.aborts.append((url, request_id))
        self.abort_tokens.append(lease_token)
