"""The router's calls to workers, and what their failures mean for the request.

The request driver (orchestrator.py), the worker set (workers.py), the tokenizer sync, the KV event
feed and the parity probe talk to workers only through `WorkerClient`, one per runtime
(runtimes/registry.py); `HttpWorkerClient` is the `tandem` runtime's (aiohttp, the internal protocol
of tandem.contracts.protocol), tests use an in-process fake. A call that fails raises one of two:
- `RouterError`: the client's fault (a 4xx about its own request): passed to it unchanged;
- `WorkerFailed`: the worker's (unreachable, a 5xx, a broken stream, or a 4xx about what the
  router itself sent: a KV handoff refused, a worker of the wrong role): the request goes to
  another worker. `dead` says whether to stop sending this one requests until its next good poll;
- `WorkerBusy` (a WorkerFailed that is never dead): a 429, or a 503 with Retry-After: the worker
  is alive and full. It is tried again later, never marked failed.
Connect, per-call and between-line timeouts bound every wait; a worker's heartbeat lines (sent
while a request waits in its queue) start the between-line timeout again, like any line.
Failure messages are the client's own (`describe`): never an aiohttp exception's repr, which
carries the request's headers and so the service secret, and never chained to one; whatever a
worker sends back (a body, a line) has the secret scrubbed before it reaches a message, the log
or the client. Redirects are never followed (they would carry the secret elsewhere).
The tokenizer sync and the KV event feed declare the narrow part of `WorkerClient` they use
(`TokenizerClient`, `KVEventClient`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from tandem.contracts import timing
from tandem.contracts.internal_auth import auth_headers
from tandem.contracts.kv_events import KVEventMessage
from tandem.contracts.names import Role
from tandem.contracts.protocol import (
    NDJSON,
    REQUEST_ID_HEADER,
    GenerateRequest,
    PrefillResult,
    StreamEvent,
    WorkerInfo,
)
from tandem.contracts.tokenizer_files import TokenizerFiles
from tandem.router.errors import RouterError

log = logging.getLogger("tandem.router")


class WorkerFailed(Exception):
    """A worker call failed for reasons of the worker's own (not the client's): try elsewhere."""

    def __init__(self, message: str, dead: bool, slow: bool = False) -> None:
        super().__init__(message)
        self.dead = dead  # unreachable or cut off: do not send it requests until it polls well again
        self.slow = slow  # it timed out (a worker too busy to answer in time, or a hung one), not refused


# 4xx codes that blame the worker or the pairing, not the client
WORKER_SIDE_CODES = frozenset(
    {"kv_backend_mismatch", "kv_mismatch", "wrong_role", "duplicate_request_id", "not_ready"}
)
# request fields only the router fills in: a 4xx about one is never the client's fault
ROUTER_FIELDS = frozenset({"kv_source", "first_token_id", "generated_token_ids", "emitted_chars"})


class HandoffDiverged(WorkerFailed):
    """A decode worker given a prefill's KV produced other tokens than the ones the client already
    has from that prefill (vLLM regenerates the handoff's first token: it must be the prefill's). A
    request goes elsewhere, as for any WorkerFailed; to the parity probe it is a disagreement."""

    def __init__(self, message: str) -> None:
        super().__init__(message, dead=False)


class WorkerBusy(WorkerFailed):
    """A worker that said it is full (429, or 503 with Retry-After): alive, try another or later."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, dead=False)
        self.retry_after_s = retry_after_s


def retry_after(header: str | None) -> float | None:
    """Retry-After in seconds (delta-seconds form), clamped to 1..60; None when absent or a date."""
    try:
        return min(60.0, max(1.0, float(header))) if header is not None else None
    except ValueError:
        return None


REDACTED = "[redacted]"


def scrub(value: object, secret: str | None) -> object:
    """`value` (text, or JSON made of dicts, lists and strings) with every occurrence of `secret`
    replaced: a worker, or an impostor, may echo the header it was sent."""
    if not secret:
        return value
    if isinstance(value, str):
        return value.replace(secret, REDACTED)
    if isinstance(value, dict):
        return {scrub(k, secret): scrub(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, secret) for v in value]
    return value


def describe(exc: BaseException) -> str:
    """A failure in words of our own: its type and text. Never its repr: aiohttp's response errors
    show the request's headers there (Authorization included)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def classify(status: int, body: object, what: str, retry_after_header: str | None = None
             ) -> RouterError | WorkerFailed:
    """The exception for a worker's non-200 answer to `what` (e.g. "prefill on http://p:8000")."""
    wait = retry_after(retry_after_header)
    if status == 429 or (status == 503 and wait is not None):
        return WorkerBusy(f"{what} is busy ({status})", wait or 1.0)
    err = body.get("error") if isinstance(body, dict) else None
    worker_side = isinstance(err, dict) and (
        err.get("code") in WORKER_SIDE_CODES or err.get("param") in ROUTER_FIELDS
    )
    if 400 <= status < 500 and status not in (408, 409, 429) and not worker_side:
        return RouterError.from_body(status, body)
    return WorkerFailed(f"{what} returned {status}: {body}", dead=False)


class WorkerClient(Protocol):
    """Everything the router asks of a worker, whatever its runtime: the seam a runtime plugs into
    (runtimes/registry.py picks one per `RouterConfig.runtime`; docs/request-lifecycle.md shows where
    each call happens). Every method takes the worker's base URL (discovery's `Target.url`) and
    speaks in tandem.contracts types; a runtime whose servers speak another protocol translates in
    its client. What each method must give, and what a vLLM client (issue 29) would map onto it, is
    said per method. Failures: `RouterError` (the client's fault, passed through), `WorkerBusy`
    (alive and full: tried elsewhere or later), `WorkerFailed` (anything else; `dead` when the
    worker is unreachable or cut off)."""

    async def info(self, url: str, role: Role | None = None) -> WorkerInfo:
        """The worker's identity and load, polled every `poll_interval_s` (workers.py): role, served
        model, max_model_len, engine_id (new on a restart), kv_compat, ready, running, waiting,
        kv_usage (0..1), outstanding_prompt_tokens, tokenizer_sha256, dtype. `role` is the one
        discovery knows (a pod label, a --prefill/--decode flag), for a runtime whose server cannot
        say its own. Raises WorkerFailed. Tandem: GET /internal/info. vLLM: `vllm:num_requests_running`,
        `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (and `vllm:cache_config_info`'s
        dtype) from GET /metrics, model and max_model_len from GET /v1/models, ready from GET
        /health, engine_id from `process_start_time_seconds`, the role as given."""
        ...

    async def prefill(self, url: str, request: GenerateRequest) -> PrefillResult:
        """Compute the prompt's KV and its first token, and keep the KV for a decode worker to pull:
        `PrefillResult.kv` says where (a KVSource), or None when the first token ends the request.
        Raises RouterError or WorkerFailed. Tandem: POST /internal/prefill. vLLM: POST
        /v1/completions with max_tokens 1 and `kv_transfer_params: {"do_remote_decode": true}`; the
        answer's `kv_transfer_params` ride in `KVSource.extra["kv_transfer_params"]` (`remote_block_ids`
        as block_ids, `remote_engine_id` as engine_id, backend "nixl", lease_token "": vLLM frees
        the blocks once read or after its own timeout)."""
        ...

    def generate(self, url: str, request: GenerateRequest) -> AsyncGenerator[StreamEvent, None]:
        """Decode (or prefill and decode): StreamEvents as they come, START first, then TOKEN (token
        ids, text delta, logprobs), HEARTBEAT while queued, and FINISH (usage), ERROR or MIGRATE last.
        `request.kv_source` set: pull that KV first; `generated_token_ids` / `emitted_chars`: tokens
        and text the client already has, never streamed again. Raises RouterError or WorkerFailed.
        Tandem: POST /internal/generate (NDJSON). vLLM: POST /v1/completions, streamed, with the
        prefill's `kv_transfer_params` (from `kv_source.extra`) and the real max_tokens, its SSE
        chunks turned into StreamEvents (no MIGRATE or HEARTBEAT: vLLM sends neither)."""
        ...

    async def abort(self, url: str, request_id: str, lease_token: str | None = None) -> None:
        """Stop the request there and free what it holds (with the lease token of a prefill result
        there, which a leased request needs); best effort, never raises. Tandem: POST
        /internal/abort. vLLM: nothing to send (closing the stream aborts it; leased prefill blocks
        expire), so a no-op."""
        ...

    async def tokenizer(self, url: str) -> TokenizerFiles:
        """The served model's tokenizer files and chat template (tokenizer_sync.py), their digest as
        `info` reports it; raises WorkerFailed (never dead). Tandem: GET /internal/tokenizer. vLLM:
        no such endpoint: raise WorkerFailed (the router sends text and vLLM tokenizes) or use
        `--tokenizer DIR`."""
        ...

    async def score(self, url: str, request_id: str, token_ids: list[int], n: int, cache_salt: str
                    ) -> list[tuple[int, float]]:
        """The teacher-forced log probability of each of the last `n` of `token_ids`, (id, logprob),
        computed there alone in one pass over them all (the handoff parity probe of a runtime whose
        generate cannot be forced through given tokens: `forces_tokens` False). Raises WorkerFailed.
        Tandem: not needed (its generate takes `forced_token_ids`). vLLM: POST /v1/completions with
        `prompt_logprobs: 0` and one token."""
        ...

    def kv_events(self, url: str) -> AsyncGenerator[KVEventMessage, None]:
        """The worker's prefix-cache blocks (kv_feed.py, for the prefix-aware policy only): a
        SNAPSHOT first, then numbered UPDATEs; raises WorkerFailed. Tandem: GET /internal/kv/events.
        vLLM: its ZMQ publisher (`--kv-events-config`), an empty SNAPSHOT then `BlockStored` /
        `BlockRemoved` / `AllBlocksCleared` as UPDATEs, hashed from their token ids with
        tandem.contracts.prefix so they match the router's."""
        ...


@dataclass
class Timeouts:
    connect_s: float = timing.CONNECT_TIMEOUT_S
    prefill_s: float = timing.PREFILL_TIMEOUT_S  # a whole prefill call, queueing included
    chunk_s: float = timing.CHUNK_TIMEOUT_S  # silence allowed between two NDJSON lines of a generate stream
    abort_s: float = 2.0
    info_s: float = 2.0


# what a broken connection, a timeout or a malformed answer raises while we read it
_BROKEN = (aiohttp.ClientError, TimeoutError, ValueError, TypeError, KeyError)
_JSON_TYPE = re.compile(r"^application/(?:[\w.+-]+?\+)?json$")  # what aiohttp's resp.json() accepts
KV_EVENT_LINE_BYTES = 2**18  # read buffer for /internal/kv/events lines (workers send under 100 KB)


class HttpWorkerClient:
    """WorkerClient over HTTP, sharing one aiohttp session."""

    forces_tokens = True  # generate takes sampling.forced_token_ids (the parity probe's teacher forcing)

    def __init__(self, session: aiohttp.ClientSession, timeouts: Timeouts | None = None,
                 secret: str | None = None) -> None:
        self.session = session
        self.timeouts = timeouts or Timeouts()
        self._auth = auth_headers(secret)  # the service's internal secret: workers want it on /internal/*
        self._secret = secret

    def _headers(self, request_id: str | None = None, **extra: str) -> dict[str, str]:
        return self._auth | ({REQUEST_ID_HEADER: request_id} if request_id else {}) | extra

    def _broken(self, what: str, exc: BaseException, dead: bool) -> WorkerFailed:
        """The failure of a call that broke (unreachable, cut off, a timeout, a malformed answer)."""
        return WorkerFailed(str(scrub(f"{what} failed: {describe(exc)}", self._secret)), dead=dead,
                            slow=isinstance(exc, TimeoutError))

    async def _error_body(self, resp: aiohttp.ClientResponse) -> object:
        """A non-200 answer's body (JSON, else its first 500 characters), the secret scrubbed."""
        raw = await resp.read()
        try:
            body: object = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", errors="replace")[:500]
        return scrub(body, self._secret)

    @staticmethod
    async def _json(resp: aiohttp.ClientResponse) -> dict:
        """A 200 answer's JSON object; ValueError for anything else (aiohttp's own error for a wrong
        Content-Type would carry the request headers)."""
        if not _JSON_TYPE.match(resp.content_type):
            raise ValueError(f"a 200 answer of Content-Type {resp.content_type!r}, not JSON")
        body = json.loads(await resp.read())
        if not isinstance(body, dict):
            raise ValueError(f"expected a JSON object, got {type(body).__name__}")
        return body

    async def info(self, url: str, role: Role | None = None) -> WorkerInfo:
        what = f"/internal/info on {url}"
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeouts.info_s)
            async with self.session.get(url + "/internal/info", headers=self._headers(), timeout=timeout,
                                        allow_redirects=False) as resp:
                if resp.status != 200:
                    raise WorkerFailed(f"{what} returned {resp.status}", dead=True)
                return WorkerInfo.from_dict(await self._json(resp))
        except _BROKEN as exc:
            raise self._broken(what, exc, dead=True) from None

    async def prefill(self, url: str, request: GenerateRequest) -> PrefillResult:
        what = f"prefill on {url}"
        timeout = aiohttp.ClientTimeout(total=self.timeouts.prefill_s, connect=self.timeouts.connect_s)
        try:
            async with self.session.post(
                url + "/internal/prefill", json=request.to_dict(),
                headers=self._headers(request.request_id), timeout=timeout, allow_redirects=False,
            ) as resp:
                if resp.status != 200:
                    raise classify(resp.status, await self._error_body(resp), what, resp.headers.get("Retry-After"))
                return PrefillResult.from_dict(await self._json(resp))
        except _BROKEN as exc:
            raise self._broken(what, exc, dead=True) from None

    async def generate(self, url: str, request: GenerateRequest) -> AsyncGenerator[StreamEvent, None]:
        what = f"generate on {url}"
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.timeouts.connect_s, sock_read=self.timeouts.chunk_s
        )
        try:
            async with self.session.post(
                url + "/internal/generate", json=request.to_dict(),
                headers=self._headers(request.request_id, Accept=NDJSON), timeout=timeout, allow_redirects=False,
            ) as resp:
                if resp.status != 200:
                    raise classify(resp.status, await self._error_body(resp), what, resp.headers.get("Retry-After"))
                async for line in resp.content:
                    line = line.strip()
                    if line:
                        yield StreamEvent.from_dict(json.loads(line))
        except _BROKEN as exc:
            raise self._broken(what, exc, dead=True) from None

    async def tokenizer(self, url: str) -> TokenizerFiles:
        """GET /internal/tokenizer, its digest checked; raises WorkerFailed (never dead: the router
        only waits longer for its tokenizer)."""
        what = f"/internal/tokenizer on {url}"
        timeout = aiohttp.ClientTimeout(total=self.timeouts.prefill_s, connect=self.timeouts.connect_s)
        try:
            async with self.session.get(url + "/internal/tokenizer", headers=self._headers(),
                                        timeout=timeout, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise WorkerFailed(f"{what} returned {resp.status}: {await self._error_body(resp)}", dead=False)
                return TokenizerFiles.from_dict(await self._json(resp))
        except _BROKEN as exc:
            raise self._broken(what, exc, dead=False) from None

    async def kv_events(self, url: str) -> AsyncGenerator[KVEventMessage, None]:
        """GET /internal/kv/events: its lines as they come, until the stream ends; raises WorkerFailed.
        The worker sends a heartbeat at least every few seconds: silence past `chunk_s` is a break."""
        what = f"/internal/kv/events on {url}"
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect_s, sock_read=self.timeouts.chunk_s)
        try:
            async with self.session.get(url + "/internal/kv/events", headers=self._headers(Accept=NDJSON),
                                        timeout=timeout, read_bufsize=KV_EVENT_LINE_BYTES,
                                        allow_redirects=False) as resp:
                if resp.status != 200:
                    raise WorkerFailed(f"{what} returned {resp.status}", dead=False)
                async for line in resp.content:
                    if line.strip():
                        yield KVEventMessage.from_dict(json.loads(line))
        except _BROKEN as exc:
            raise self._broken(what, exc, dead=False) from None

    async def abort(self, url: str, request_id: str, lease_token: str | None = None) -> None:
        body = {"request_id": request_id} | ({"lease_token": lease_token} if lease_token else {})
        try:
            async with self.session.post(
                url + "/internal/abort", json=body, headers=self._headers(request_id),
                timeout=aiohttp.ClientTimeout(total=self.timeouts.abort_s), allow_redirects=False,
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("%s", self._broken(f"abort of {request_id} on {url}", exc, dead=False))
