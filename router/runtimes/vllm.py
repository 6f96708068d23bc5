"""The `vllm` runtime: the router reaches `vllm serve` servers (prefill and decode paired by vLLM's
NixlConnector, tandem.contracts.vllm_serve) over vLLM's own OpenAI API, and speaks its
disaggregation protocol: a prefill is a one-token completion with `kv_transfer_params:
{"do_remote_decode": true}`, whose answer's `kv_transfer_params` the router carries in the KVSource
to the decode server's streamed completion. What each WorkerClient method maps onto is said in
router/worker_client.py; the request mapping is vllm_request.py, the stream vllm_stream.py, the load
vllm_info.py, the KV events vllm_kv_events.py.

Every call carries the service's internal secret (`Authorization: Bearer`), which the operator gives
vLLM as its API key. vLLM serves no tokenizer files: the router reads them from the `tokenizer` folder this runtime
requires (and `info` reports their digest), tokenizes every request, and names logprob tokens with
them. vLLM sends no heartbeat while a request waits: the first chunk may take `prefill_timeout_s`
(queueing included), later chunks `chunk_timeout_s`. Closing a stream aborts the request in vLLM, so
`abort` sends nothing; KV a prefill server keeps for a decode that never comes is freed after its
lease (kv_lease_duration, contracts.timing.VLLM_KV_LEASE_S; the decode server's heartbeats extend
it once the request reached it, and the router hands it over within the lease). A decode server
regenerates the handoff's first token: one that is not the prefill's is a HandoffDiverged, and the
request is recomputed, never continued from that KV.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from tandem.contracts.internal_auth import auth_headers
from tandem.contracts.kv_events import KVEventMessage, KVEventType
from tandem.contracts.kv_source import KVSource
from tandem.contracts.names import Role
from tandem.contracts.protocol import (
    REQUEST_ID_HEADER,
    FinishReason,
    GenerateRequest,
    PrefillResult,
    StreamEvent,
    WorkerInfo,
)
from tandem.contracts.tokenizer_files import TokenizerFiles
from tandem.contracts.vllm_serve import BLOCK_SIZE, KV_EVENTS_TOPIC
from tandem.router.config import RouterConfig, check_complete
from tandem.router.runtimes.vllm_info import Metrics, parse_metrics, parse_models, worker_info
from tandem.router.runtimes.vllm_kv_events import KVEventTranslator, decode_batch
from tandem.router.runtimes.vllm_request import KV_TRANSFER_PARAMS, decode_call, prefill_body, room
from tandem.router.runtimes.vllm_stream import (
    DecodeStream,
    TokenMismatch,
    logprobs_wire,
    prompt_echo,
    unsent_text,
)
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.tokenizer_sync import read_dir
from tandem.router.worker_client import (
    HandoffDiverged,
    Timeouts,
    WorkerFailed,
    classify,
    describe,
    scrub,
)

log = logging.getLogger("tandem.router.vllm")

_BROKEN = (aiohttp.ClientError, TimeoutError, ValueError, TypeError, KeyError, IndexError)
KV_EVENTS_HEARTBEAT_S = 5.0  # a quiet subscription says so this often (and checks for a restart)
READ_BUFFER = 2**20  # a streamed chunk with 20 logprobs a token stays far below this


@dataclass(frozen=True)
class _Engine:
    """What one server process said about itself (asked again when its engine changes)."""

    engine_id: str
    model: str
    max_model_len: int
    block_size: int  # its KV cache's (vLLM's CPU build needs a multiple of 32, GPUs run 16)


class VllmWorkerClient:
    """WorkerClient for vLLM servers, sharing the router's aiohttp session."""

    forces_tokens = False  # vLLM samples every generated token: the parity probe scores with `score`

    def __init__(self, session: aiohttp.ClientSession, timeouts: Timeouts, tokenizer_dir: str,
                 kv_events_port: int, kv_events_endpoints: dict[str, str] | None = None,
                 secret: str | None = None) -> None:
        self.session, self.timeouts = session, timeouts
        self._auth, self._secret = auth_headers(secret), secret  # vLLM's --api-key (VLLM_API_KEY) is it
        self.files = read_dir(tokenizer_dir)
        self._tokenizer = RouterTokenizer.from_files(self.files.files)
        self.kv_events_port, self.kv_events_endpoints = kv_events_port, dict(kv_events_endpoints or {})
        self._engines: dict[str, _Engine] = {}
        self._texts: dict[int, str] = {}

    # --- naming tokens ------------------------------------------------------------------------

    def _text(self, token_id: int) -> str:
        """A token's text as Tandem's workers give it in logprobs (decoded alone, specials kept)."""
        t = self._texts.get(token_id)
        if t is None:
            t = self._tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._texts) < 1 << 20:
                self._texts[token_id] = t
        return t

    # --- info ---------------------------------------------------------------------------------

    async def _get(self, url: str, limit: aiohttp.ClientTimeout) -> tuple[int, bytes]:
        async with self.session.get(url, headers=self._auth, timeout=limit, allow_redirects=False) as resp:
            return resp.status, await resp.read()

    async def _engine(self, url: str, metrics: Metrics, limit: aiohttp.ClientTimeout) -> _Engine:
        engine_id = f"{urlsplit(url).netloc}-{metrics.started}"
        known = self._engines.get(url)
        if known is None or known.engine_id != engine_id:
            status, raw = await self._get(url + "/v1/models", limit)
            if status in (401, 403):
                raise WorkerFailed(_refused(url, status), dead=True)
            if status != 200:
                raise ValueError(f"/v1/models returned {status}")
            model, max_model_len = parse_models(json.loads(raw))
            known = self._engines[url] = _Engine(engine_id, model, max_model_len, metrics.block_size(BLOCK_SIZE))
        return known

    async def info(self, url: str, role: Role | None = None) -> WorkerInfo:
        what = f"the metrics of {url}"
        timeout = aiohttp.ClientTimeout(total=self.timeouts.info_s)
        step = "GET /metrics"
        try:
            status, raw = await self._get(url + "/metrics", timeout)
            if status != 200:
                raise WorkerFailed(f"{what}: GET /metrics returned {status}", dead=True)
            metrics = parse_metrics(raw.decode("utf-8", errors="replace"))
            step = "GET /v1/models"
            engine = await self._engine(url, metrics, timeout)
            step = "GET /health"
            health, _ = await self._get(url + "/health", timeout)
        except _BROKEN as exc:
            raise WorkerFailed(f"{what} failed ({step}): {describe(exc)}", dead=True,
                               slow=isinstance(exc, TimeoutError)) from None
        return worker_info(metrics, engine.model, engine.max_model_len, engine.engine_id,
                           role or Role.COLOCATED, health == 200, self.files.sha256)

    async def _known(self, url: str) -> _Engine:
        """The server's model and context length (asked once per engine; the poll keeps it current)."""
        known = self._engines.get(url)
        if known is None:
            await self.info(url)
            known = self._engines[url]
        return known

    # --- prefill ------------------------------------------------------------------------------

    async def _post(self, url: str, body: dict[str, Any], request_id: str, limit: aiohttp.ClientTimeout
                    ) -> aiohttp.ClientResponse:
        resp = await self.session.post(url + "/v1/completions", json=body, headers=self._auth | {REQUEST_ID_HEADER: request_id},
                                       timeout=limit, allow_redirects=False, read_bufsize=READ_BUFFER)
        if resp.status in (401, 403):  # never the client's fault: the router's secret is not vLLM's API key
            resp.release()
            raise WorkerFailed(_refused(url, resp.status), dead=False)
        if resp.status != 200:
            async with resp:
                raw = await resp.read()
                raise classify(resp.status, scrub(openai_body(resp.status, raw), self._secret), f"completion on {url}",
                               resp.headers.get("Retry-After"))
        return resp

    async def prefill(self, url: str, request: GenerateRequest) -> PrefillResult:
        what = f"prefill on {url}"
        timeout = aiohttp.ClientTimeout(total=self.timeouts.prefill_s, connect=self.timeouts.connect_s)
        try:
            engine = await self._known(url)
            body = prefill_body(request, engine.model, engine.max_model_len)
            async with await self._post(url, body, request.request_id, timeout) as resp:
                answer = await resp.json(content_type=None)
            return self._prefilled(url, request, body["prompt"], answer, engine.max_model_len)
        except _BROKEN as exc:
            raise WorkerFailed(f"{what} failed: {describe(exc)}", dead=True) from None

    def _prefilled(self, url: str, request: GenerateRequest, prompt: list[int], answer: dict[str, Any],
                   max_model_len: int) -> PrefillResult:
        choice = answer["choices"][0]
        first, text, reason = choice["token_ids"][0], choice.get("text") or "", choice.get("finish_reason")
        s = request.sampling
        finish = None
        if reason == "stop":
            finish = FinishReason.STOP
        elif room(s.max_tokens, len(prompt), max_model_len) <= 1:
            finish = FinishReason.LENGTH
        kv = None
        if finish is None:
            params = answer.get(KV_TRANSFER_PARAMS)
            if not isinstance(params, dict) or not params.get("remote_block_ids"):
                raise WorkerFailed(f"prefill on {url} kept no KV for a decode server (is it a kv_producer?)",
                                   dead=False)
            kv = kv_source(url, params, len(prompt))
        lps = logprobs_wire(choice.get("logprobs"), 1, s.logprobs, self._text) if s.logprobs is not None else []
        return PrefillResult(request.request_id, prompt, first, text, finish, kv, lps[0] if lps else None)

    # --- generate -----------------------------------------------------------------------------

    async def generate(self, url: str, request: GenerateRequest) -> AsyncGenerator[StreamEvent, None]:
        what = f"generate on {url}"
        # the headers within a prefill's time; each chunk within its own wait below
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect_s, sock_read=self.timeouts.prefill_s)
        try:
            engine = await self._known(url)
            call = decode_call(request, engine.model, engine.max_model_len)
            unsent = unsent_text(self._tokenizer.decode, request.prompt_token_ids or [], call.replayed,
                                 call.emitted_chars)
            echo = prompt_echo(self._tokenizer.decode, request.prompt_token_ids or [], call.replayed)
            stream = DecodeStream(call, self._text, request.sampling.logprobs, unsent, echo)
            async with await self._post(url, call.body, request.request_id, timeout) as resp:
                lines = aiter(resp.content)
                while not stream.finished:
                    wait = self.timeouts.chunk_s if stream.started else self.timeouts.prefill_s
                    line = (await asyncio.wait_for(anext(lines, b""), wait)).strip()
                    if not line:
                        if resp.content.at_eof():
                            raise WorkerFailed(f"{what}: the stream ended without a finish", dead=True)
                        continue
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        for ev in stream.chunk(json.loads(line[5:])):
                            yield ev
        except TokenMismatch as exc:
            if request.kv_source is not None:
                raise HandoffDiverged(f"{what}: {exc}, after pulling the prefill's KV") from None
            raise WorkerFailed(f"{what}: {exc}", dead=False) from None
        except _BROKEN as exc:
            raise WorkerFailed(f"{what} failed: {describe(exc)}", dead=True) from None

    async def score(self, url: str, request_id: str, token_ids: list[int], n: int, cache_salt: str
                    ) -> list[tuple[int, float]]:
        """The last `n` tokens' teacher-forced logprobs: vLLM's `prompt_logprobs` of `token_ids` as a
        prompt (one forward pass over them; the cache salt keeps any cached KV out of it)."""
        what = f"scoring on {url}"
        timeout = aiohttp.ClientTimeout(total=self.timeouts.prefill_s, connect=self.timeouts.connect_s)
        try:
            engine = await self._known(url)
            body = {"model": engine.model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
                    "prompt_logprobs": 0, "cache_salt": cache_salt, "stream": False}
            async with await self._post(url, body, request_id, timeout) as resp:
                answer = await resp.json(content_type=None)
            return scored_prompt(answer["choices"][0]["prompt_logprobs"], token_ids, n)
        except _BROKEN as exc:
            raise WorkerFailed(f"{what} failed: {describe(exc)}", dead=False) from None

    async def abort(self, url: str, request_id: str, lease_token: str | None = None) -> None:
        """Nothing to send: the router closing the stream aborts it in vLLM."""

    async def tokenizer(self, url: str) -> TokenizerFiles:
        return self.files

    # --- KV events ----------------------------------------------------------------------------

    def kv_endpoint(self, url: str) -> str:
        """Where `url`'s server publishes its KV events: as configured, else its host at kv_events_port."""
        if url in self.kv_events_endpoints:
            return self.kv_events_endpoints[url]
        host = urlsplit(url).hostname or "127.0.0.1"
        return f"tcp://{'[' + host + ']' if ':' in host else host}:{self.kv_events_port}"

    async def kv_events(self, url: str) -> AsyncGenerator[KVEventMessage, None]:
        import zmq
        import zmq.asyncio

        engine = await self._known(url)
        translator = KVEventTranslator(engine.engine_id, engine.block_size)
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
            sock.connect(self.kv_endpoint(url))
            yield translator.snapshot()
            while True:
                if not await sock.poll(KV_EVENTS_HEARTBEAT_S * 1000):
                    now = self._engines.get(url)
                    if now is not None and now.engine_id != engine.engine_id:
                        raise WorkerFailed(f"the KV events of {url}: its engine restarted", dead=False)
                    yield KVEventMessage(KVEventType.HEARTBEAT, translator.seq)
                    continue
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    raise WorkerFailed(f"the KV events of {url}: a message of {len(frames)} frames", dead=False)
                if not translator.follows(int.from_bytes(frames[1], "big", signed=True)):
                    raise WorkerFailed(f"the KV events of {url}: batches lost or the publisher restarted",
                                       dead=False)
                for msg in translator.updates(decode_batch(frames[2])):
                    yield msg
        except (zmq.ZMQError, ValueError) as exc:
            raise WorkerFailed(f"the KV events of {url}: {describe(exc)}", dead=False) from None
        finally:
            sock.close(linger=0)
            if translator.skipped:
                log.info("KV events of %s: %d blocks could not be named", url, translator.skipped)


def _refused(url: str, status: int) -> str:
    return (f"{url} refused the router's internal secret ({status}): vLLM's API key (VLLM_API_KEY) must be "
            "the service's secret ($TANDEM_INTERNAL_SECRET)")


def openai_body(status: int, raw: bytes) -> object:
    """vLLM's error answer in the router's words: OpenAI's shape with the router's `type` for the
    status (vLLM names its exception class there) and a string `code` or none (vLLM repeats the
    status), so a refusal reads the same whichever runtime made it. Other bodies: their text."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace")[:500]
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return body
    code = err.get("code")
    return {"error": {"message": str(err.get("message", "")), "param": err.get("param"),
                      "type": "invalid_request_error" if 400 <= status < 500 else "server_error",
                      "code": code if isinstance(code, str) else None}}


def scored_prompt(prompt_logprobs: list[Any], token_ids: list[int], n: int) -> list[tuple[int, float]]:
    """(id, logprob) of each of the last `n` prompt tokens from vLLM's `prompt_logprobs`: one entry
    per prompt token (the first None), each a map of token id (a string in JSON) to its Logprob,
    the prompt's own token always among them. ValueError when it does not hold them."""
    if len(prompt_logprobs) != len(token_ids) or not 0 < n < len(token_ids):
        raise ValueError(f"prompt_logprobs for {len(prompt_logprobs)} tokens, the prompt has {len(token_ids)}")
    out = []
    for tid, entry in zip(token_ids[-n:], prompt_logprobs[-n:], strict=True):
        lp = (entry or {}).get(str(tid))
        if not isinstance(lp, dict):
            raise ValueError(f"prompt_logprobs lack the prompt's own token {tid}")
        out.append((tid, float(lp["logprob"])))
    return out


def kv_source(url: str, params: dict[str, Any], num_tokens: int) -> KVSource:
    """The KVSource a decode worker pulls: vLLM's kv_transfer_params, whole, in `extra`."""
    blocks = params.get("remote_block_ids") or []
    if blocks and isinstance(blocks[0], list):  # one list per KV cache group
        blocks = blocks[0]
    return KVSource(url=url, engine_id=str(params.get("remote_engine_id", "")), backend="nixl",
                    block_ids=[int(b) for b in blocks], num_tokens=num_tokens, lease_token="",
                    extra={KV_TRANSFER_PARAMS: params})


def create_client(session: aiohttp.ClientSession, config: RouterConfig) -> VllmWorkerClient:
    """The client with the configured timeouts, tokenizer folder and KV event endpoints."""
    check_complete(config)
    timeouts = Timeouts(connect_s=config.connect_timeout_s, prefill_s=config.prefill_timeout_s,
                        chunk_s=config.chunk_timeout_s)
    return VllmWorkerClient(session, timeouts, config.tokenizer, config.kv_events_port, config.kv_events_endpoints,
                            secret=config.internal_secret)
