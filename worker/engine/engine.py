"""The engine: a model, one paged KV pool, a scheduler, and the step that ties them together.

`Engine` is synchronous and owns all sequence state (guarded by one lock); `AsyncEngine`
(async_engine.py) runs its steps on a dedicated thread for the HTTP server. Tests and benchmarks
drive `Engine` directly.
"""

from __future__ import annotations

import hmac
import logging
import os
import random
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from tandem.contracts.protocol import FinishReason, GenerateRequest, SamplingParams
from tandem.worker.engine.block_allocator import BlockAllocator
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.decode_step import prepare_kernels
from tandem.worker.engine.detokenizer import IncrementalDetokenizer
from tandem.worker.engine.errors import ModelLoadError, RequestError
from tandem.worker.engine.loader import LoadedModel, load_model
from tandem.worker.engine.paged_forward import BatchItem, PagedForward, kv_layout_for
from tandem.worker.engine.prefix_cache import PrefixCache, PublishingLock, prefix_salt
from tandem.worker.engine.sampling import sample
from tandem.worker.engine.scheduler import Scheduler
from tandem.worker.engine.sequence import SeqOutput, SeqStatus, Sequence
from tandem.worker.engine.weights import model_weights

log = logging.getLogger("tandem.worker.engine")


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    steps_total: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)


@dataclass
class PullReservation:
    """Blocks held for a pulled prompt: `cached` already hold its leading blocks, `fresh` receive
    the rest from the prefill worker."""

    cached: list[int]
    fresh: list[int]

    @property
    def blocks(self) -> list[int]:
        return self.cached + self.fresh


@dataclass
class Lease:
    seq: Sequence
    expires: float  # time.monotonic()
    # Handed out with the prefill result (KVSource.lease_token); reads and releases must quote it.
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)


def _same_token(expected: str, given: str) -> bool:
    """Constant-time token comparison (a wrong token must not tell how much of it was right)."""
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, lease_s: float = 30.0):
        if config.threads:
            torch.set_num_threads(config.threads)
        if config.block_size < 1 or config.max_num_seqs < 1 or config.max_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_batched_tokens must be >= 1")
        if config.prefill_chunk_tokens is not None and config.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1 (or unset: max_batched_tokens)")
        if config.max_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_batched_tokens ({config.max_batched_tokens}) must be >= max_num_seqs "
                f"({config.max_num_seqs}) so every running sequence can decode each step"
            )
        self.config = config
        self.loaded = loaded or load_model(
            config.model, dtype=config.dtype, device=config.device, max_model_len=config.max_model_len,
            trust_remote_code=config.trust_remote_code,
        )
        lm = self.loaded
        self.tokenizer = lm.tokenizer
        self.vocab_size = int(lm.config.vocab_size)
        self.served_name = config.served_name or lm.name
        probe = kv_layout_for(lm.config, 1, config.block_size, lm.dtype)
        num_blocks = config.num_blocks
        if num_blocks is None:
            default_fraction = 0.9 if lm.device.type == "cuda" else 0.25
            fraction = config.kv_memory_fraction or default_fraction
            num_blocks = int(_available_memory(lm.device) * fraction) // probe.block_bytes
            # On a CPU there is no point in more than every sequence at full context.
            if lm.device.type == "cpu" and config.kv_memory_fraction is None:
                num_blocks = min(num_blocks, config.max_num_seqs * probe.blocks_for(lm.max_model_len))
        if num_blocks < 1:
            raise ModelLoadError("no memory left for the KV pool; lower kv_memory_fraction or set num_blocks")
        self.layout = kv_layout_for(lm.config, num_blocks, config.block_size, lm.dtype)
        self.max_model_len = lm.max_model_len
        if config.max_model_len is not None:
            self.max_model_len = min(config.max_model_len, lm.max_model_len)
        if self.max_model_len > num_blocks * config.block_size:
            log.warning(
                "context length capped from %d to %d tokens: the KV pool holds only %d blocks of %d",
                self.max_model_len, num_blocks * config.block_size, num_blocks, config.block_size)
            self.max_model_len = num_blocks * config.block_size
        # One contiguous tensor for the whole pool, allocated once: transports register it once.
        self.pool = torch.zeros(self.layout.shape, dtype=lm.dtype, device=lm.device)
        log.info("KV pool: %d blocks of %d tokens, %.1f MiB", num_blocks, config.block_size,
                 self.pool.numel() * self.pool.element_size() / 2**20)
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_hash_salt = prefix_salt(self.layout, str(lm.config.model_type), self.vocab_size)
        self.prefix_cache = PrefixCache(self.allocator, config.block_size, self.prefix_hash_salt,
                                        enabled=config.prefix_caching)
        self.scheduler = Scheduler(
            self.allocator, config.block_size, config.max_num_seqs, config.max_batched_tokens,
            on_preempt=self._on_preempt, prefill_chunk_tokens=config.prefill_chunk_tokens,
            prefix_cache=self.prefix_cache,
        )
        weights = model_weights(lm)
        kernels, why = prepare_kernels(weights, config.compile, self.pool, self.max_model_len)
        self.runner = PagedForward(weights, self.pool, self.layout, kernels)
        log.info("engine: %s on %s, %d thread(s); decode step: %s; prefill up to %d prompt tokens per step; "
                 "prefix caching %s", str(lm.dtype).removeprefix("torch."), lm.device, torch.get_num_threads(),
                 why, self.scheduler.prefill_chunk_tokens, "on" if config.prefix_caching else "off")
        # Guards all sequence and block state; publishes the prefix cache's changes on release.
        self.lock = PublishingLock(self._publish_kv_events)
        if config.prefix_caching:
            # Only an engine that caches has the hook, so the KV event stream sees one that does
            # not as having no prefix cache (worker/server/kv_events.py: KVEventSource).
            self.on_kv_event: Callable[[list[bytes], list[bytes]], None] = lambda stored, removed: None
        self.seqs: dict[str, Sequence] = {}  # waiting or running, by request id
        self.leases: dict[str, Lease] = {}  # prefill role: blocks kept for a peer to pull
        self.lease_s = lease_s
        self.stats = EngineStats()
        self.on_step: Callable[[float, int], None] = lambda seconds, num_tokens: None
        # Called when blocks come back from outside the step (a lease released, a pull given up),
        # so a step loop waiting for free blocks wakes up.
        self.on_blocks_freed: Callable[[], None] = lambda: None
        self._in_flight: set[str] = set()
        self._abort_after_step: set[str] = set()

    # ---- requests in ----------------------------------------------------------------------

    def tokenize(self, req: GenerateRequest) -> list[int]:
        given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
        if sum(given) != 1:
            raise RequestError("give exactly one of prompt, messages or prompt_token_ids", param="prompt")
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
            if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise RequestError(
                    f"prompt_token_ids must be a list of token ids in [0, {self.vocab_size})", param="prompt")
            return list(ids)
        if req.prompt is not None:
            if not isinstance(req.prompt, str):
                raise RequestError("prompt must be a string", param="prompt")
            return list(self.tokenizer(req.prompt)["input_ids"])
        if not isinstance(req.messages, list) or not all(isinstance(m, dict) for m in req.messages):
            raise RequestError("messages must be a list of objects with role and content", param="messages")
        try:
            enc = self.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        except Exception as e:  # noqa: BLE001 - template errors come in many types
            raise RequestError(f"cannot apply the chat template to messages: {e}", param="messages") from e
        return list(enc["input_ids"])

    def validate_sampling(self, p: SamplingParams) -> None:
        def bad(msg: str, param: str) -> RequestError:
            return RequestError(msg, param=param, code="invalid_value")

        if isinstance(p.max_tokens, bool) or not isinstance(p.max_tokens, int) or p.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {p.max_tokens!r}", "max_tokens")
        if not isinstance(p.temperature, int | float) or p.temperature < 0:
            raise bad(f"temperature must be >= 0, got {p.temperature!r}", "temperature")
        if not isinstance(p.top_p, int | float) or not 0 < p.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {p.top_p!r}", "top_p")
        if not isinstance(p.top_k, int) or (p.top_k < 1 and p.top_k not in (-1, 0)):
            raise bad(f"top_k must be -1 (off) or >= 1, got {p.top_k!r}", "top_k")
        if p.seed is not None and not isinstance(p.seed, int):
            raise bad("seed must be an integer", "seed")
        if isinstance(p.stop, str):
            p.stop = [p.stop]
        if not isinstance(p.stop, list) or not all(isinstance(s, str) for s in p.stop):
            raise bad("stop must be a string or a list of strings", "stop")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in p.stop_token_ids):
            raise bad(f"stop_token_ids must be token ids in [0, {self.vocab_size})", "stop_token_ids")

    def make_sequence(self, req: GenerateRequest, *, prefill_only: bool = False) -> Sequence:
        """Tokenize and validate a request; raises RequestError (a 4xx) for anything wrong with it."""
        if not isinstance(req.request_id, str) or not req.request_id:
            raise RequestError("request_id must be a non-empty string", param="request_id")
        if not isinstance(req.sampling, SamplingParams):
            raise RequestError("sampling must be an object", param="sampling")
        self.validate_sampling(req.sampling)
        prompt = self.tokenize(req)
        if not prompt:
            raise RequestError("the prompt is empty", param="prompt")
        resumed = self._generated_ids(req)
        if len(prompt) + len(resumed) >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(prompt)} tokens" + (f" (+{len(resumed)} already generated)" if resumed else "")
                + ", leaving no room for a completion. Please shorten the prompt.",
                param="messages" if req.messages is not None else "prompt", code="context_length_exceeded",
            )
        if len(resumed) >= req.sampling.max_tokens:
            raise RequestError(
                f"generated_token_ids already holds {len(resumed)} tokens, max_tokens is "
                f"{req.sampling.max_tokens}: nothing left to generate", param="max_tokens", code="invalid_value")
        p = req.sampling
        seq = Sequence(
            request_id=req.request_id, prompt_ids=prompt, params=p, max_total_len=self.max_model_len,
            seed=p.seed if p.seed is not None else random.getrandbits(62), eos_ids=self.loaded.eos_ids,
            prefill_only=prefill_only, arrival=time.monotonic(), num_resumed=len(resumed),
        )
        seq.detok = IncrementalDetokenizer(self.tokenizer, prompt, p.stop)
        self._replay(seq, resumed, req.emitted_chars)
        return seq

    def _generated_ids(self, req: GenerateRequest) -> list[int]:
        """generated_token_ids, or [first_token_id] (its older spelling), checked to be token ids."""
        resumed = [] if req.generated_token_ids is None else req.generated_token_ids
        if req.first_token_id is not None and isinstance(resumed, list) and not resumed:
            resumed = [req.first_token_id]
        if not isinstance(resumed, list) or not all(self._is_token(t) for t in resumed):
            raise RequestError("generated_token_ids must be token ids", param="generated_token_ids")
        if req.first_token_id is not None and resumed[0] != req.first_token_id:
            raise RequestError("first_token_id differs from generated_token_ids[0]", param="first_token_id")
        return list(resumed)

    def _is_token(self, t: object) -> bool:
        return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size

    def _replay(self, seq: Sequence, resumed: list[int], emitted_chars: int | None) -> None:
        """Run tokens generated elsewhere through the stop rules and the detokenizer, as the worker
        that sampled them did, so this one continues from the same state; a request those tokens
        already ended is left FINISHED (its producer died before it could say so)."""
        for i, tok in enumerate(resumed):
            seq.output_ids.append(tok)
            reason = self._finish_reason(seq, tok)
            seq.detok.take()
            if reason is not None:
                if i != len(resumed) - 1:
                    raise RequestError(f"generated_token_ids go on after token {i} ended the request",
                                       param="generated_token_ids")
                seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if emitted_chars is not None:
            try:
                seq.detok.resume_at(emitted_chars)
            except ValueError as e:
                raise RequestError(f"emitted_chars: {e}", param="emitted_chars") from e

    def add(self, seq: Sequence) -> None:
        """Queue a sequence to be prefilled (locally) and decoded."""
        with self.lock:
            self._register(seq)
            self.stats.prompt_tokens_total += len(seq.prompt_ids)
            self.scheduler.add(seq)

    def _register(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise RequestError(f"request {seq.request_id!r} is already running here",
                               status=409, param="request_id", code="duplicate_request_id")
        self.seqs[seq.request_id] = seq

    def reserve_for_pull(self, seq: Sequence) -> PullReservation | None:
        """Blocks for the prompt's KV before a pull: the leading blocks this pool already caches
        (at least the last block is still pulled: the pull also ends the peer's lease), then new
        blocks for the rest; None when the pool is too full right now."""
        n = len(seq.prompt_ids)
        with self.lock:
            hit = self.prefix_cache.match(seq, n - 1)
            need = self.layout.blocks_for(n) - len(hit)
            if need + self.allocator.num_to_take(hit) > self.allocator.num_free:
                return None
            self.prefix_cache.hit(hit, n)
            return PullReservation(cached=hit, fresh=self.allocator.allocate(need))

    def free_blocks(self, block_ids: list[int]) -> None:
        with self.lock:
            self.allocator.free(block_ids)
        self.on_blocks_freed()

    def add_prefilled(self, seq: Sequence, block_ids: list[int]) -> None:
        """Join the running batch with the prompt's KV already in block_ids (pulled from a prefill
        worker, or cached here); the prefill's first token, replayed by make_sequence, is the
        next one to run."""
        with self.lock:
            self._register(seq)
            seq.block_table = list(block_ids)
            seq.num_computed = len(seq.prompt_ids)
            self.prefix_cache.commit(seq)
            self.stats.prompt_tokens_total += len(seq.prompt_ids)
            self.scheduler.add_running(seq)

    def abort(self, request_id: str, lease_token: str | None = None) -> bool:
        """Cancel a request and free what it holds here: a running sequence, and its KV lease
        when lease_token proves it (the lease's token went only to the decode worker and router)."""
        found = lease_token is not None and self.release_lease(request_id, lease_token)
        with self.lock:
            seq = self.seqs.get(request_id)
            if seq is None:
                return found
            if request_id in self._in_flight:
                self._abort_after_step.add(request_id)
                return True
            self._finish(seq, FinishReason.ABORT)
            out = SeqOutput(request_id, text=seq.detok.take(final=True), finished=True,
                            finish_reason=FinishReason.ABORT)
        self._emit(seq, out)
        return True

    # ---- leases (prefill role) ------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Free the blocks a prefill result leased (expired, or its result never handed out).
        In-process callers only: peers go through release_lease, which wants the token."""
        return self._drop_lease(request_id, None)

    def release_lease(self, request_id: str, lease_token: str) -> bool:
        """LeaseKeeper: free a lease whose token a peer quoted (pulled, released or given up);
        False, freeing nothing, for a wrong token or a lease already gone."""
        return self._drop_lease(request_id, lease_token)

    def check_read(self, request_id: str, lease_token: str, block_ids: Collection[int]) -> bool:
        """LeaseKeeper: whether a peer may read these blocks: a live lease of request_id, proven
        by its token, holds every one of them."""
        with self.lock:
            lease = self.leases.get(request_id)
            return (lease is not None and _same_token(lease.token, lease_token)
                    and lease.expires > time.monotonic() and set(block_ids) <= set(lease.seq.block_table))

    def lease_token(self, request_id: str) -> str | None:
        """The token of request_id's live lease, to hand out with its prefill result."""
        with self.lock:
            lease = self.leases.get(request_id)
            return None if lease is None else lease.token

    def _drop_lease(self, request_id: str, lease_token: str | None) -> bool:
        with self.lock:
            lease = self.leases.get(request_id)
            if lease is None or (lease_token is not None and not _same_token(lease.token, lease_token)):
                return False
            del self.leases[request_id]
            self.scheduler.free_blocks(lease.seq)
            lease.seq.status = SeqStatus.FINISHED
        self.on_blocks_freed()
        return True

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self.lock:
            expired = [rid for rid, lease in self.leases.items() if lease.expires <= now]
        for rid in expired:
            log.warning("KV lease expired before a peer pulled it", extra={"request_id": rid})
            self.release(rid)
        return expired

    def next_lease_expiry(self) -> float | None:
        with self.lock:
            return min((lease.expires for lease in self.leases.values()), default=None)

    # ---- the step ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> int:
        """Run one forward pass over the scheduled batch; returns the number of tokens processed."""
        t0 = time.perf_counter()
        with self.lock:
            chunks = self.scheduler.schedule()
            if not chunks:
                return 0
            items = [
                BatchItem(c.seq.all_ids[c.start : c.start + c.num_tokens], c.start, list(c.seq.block_table), c.sample)
                for c in chunks
            ]
            self._in_flight = {c.seq.request_id for c in chunks}
        try:
            out = self.runner.forward(items)
            sampled = [c for c in chunks if c.sample]
            tokens = sample(
                out.logits, [c.seq.params for c in sampled], [c.seq.seed for c in sampled],
                [len(c.seq.output_ids) for c in sampled], out.argmax)
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            log.exception("forward pass failed; failing %d sequences", len(chunks))
            self._fail(chunks, e)
            return 0
        emits: list[tuple[Sequence, SeqOutput]] = []
        with self.lock:
            self._in_flight = set()
            it = iter(tokens)
            for c in chunks:
                seq = c.seq
                seq.num_computed += c.num_tokens
                self.prefix_cache.commit(seq)
                if not c.sample:
                    continue
                tok = next(it)
                if seq.finished:
                    continue
                emits.append((seq, self._append_token(seq, tok)))
            for rid in self._abort_after_step:
                seq = self.seqs.get(rid)
                if seq is not None:
                    self._finish(seq, FinishReason.ABORT)
                    emits.append((seq, SeqOutput(rid, text=seq.detok.take(final=True), finished=True,
                                                 finish_reason=FinishReason.ABORT)))
            self._abort_after_step = set()
            self.stats.steps_total += 1
        n = sum(c.num_tokens for c in chunks)
        self.on_step(time.perf_counter() - t0, n)  # before the outputs: a reader sees its own step
        for seq, out in emits:
            self._emit(seq, out)
        return n

    def _append_token(self, seq: Sequence, tok: int) -> SeqOutput:
        """Add a sampled token, apply the stop rules, finish or lease the sequence; under the lock."""
        seq.output_ids.append(tok)
        self.stats.generation_tokens_total += 1
        reason = self._finish_reason(seq, tok)
        out = SeqOutput(seq.request_id, token_ids=[tok])
        if reason is not None:
            self._finish(seq, reason)
            out.text, out.finished, out.finish_reason = seq.detok.take(final=True), True, reason
        else:
            out.text = seq.detok.take()
            if seq.prefill_only:
                self._lease(seq)
                out.kv_blocks = list(seq.block_table)
        return out

    @staticmethod
    def _finish_reason(seq: Sequence, tok: int) -> FinishReason | None:
        """The stop rules for `tok`, just appended to seq.output_ids (it also feeds the detokenizer)."""
        p = seq.params
        if (tok in seq.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids or seq.detok.add(tok):
            return FinishReason.STOP
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= seq.max_total_len:
            return FinishReason.LENGTH
        return None

    def _lease(self, seq: Sequence) -> None:
        self.scheduler.running.remove(seq)
        del self.seqs[seq.request_id]
        seq.status = SeqStatus.LEASED
        self.leases[seq.request_id] = Lease(seq, time.monotonic() + self.lease_s)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.stats.requests_finished[reason.value] = self.stats.requests_finished.get(reason.value, 0) + 1
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.request_id, None)
        self.scheduler.remove(seq)

    def _fail(self, chunks, error: Exception) -> None:
        """A forward pass raised: fail the sequences it carried (the rest keep running)."""
        emits = []
        with self.lock:
            self._in_flight = set()
            self._abort_after_step = set()
            for c in chunks:
                if not c.seq.finished:
                    self._finish(c.seq, FinishReason.ERROR)
                    emits.append((c.seq, self._error_output(c.seq, error)))
        for seq, out in emits:
            self._emit(seq, out)

    @staticmethod
    def _error_output(seq: Sequence, error: Exception) -> SeqOutput:
        return SeqOutput(seq.request_id, finished=True, finish_reason=FinishReason.ERROR,
                         error={"message": f"the engine failed: {error}", "type": "internal_error",
                                "param": None, "code": "engine_error"})

    def fail_all(self, error: Exception) -> None:
        """End every waiting and running sequence with an error (the step loop itself broke), so
        no client waits on a sequence the engine can no longer advance."""
        emits = []
        with self.lock:
            self._in_flight = set()
            self._abort_after_step = set()
            for seq in list(self.seqs.values()):
                self._finish(seq, FinishReason.ERROR)
                emits.append((seq, self._error_output(seq, error)))
        for seq, out in emits:
            self._emit(seq, out)

    def _on_preempt(self, seq: Sequence) -> None:
        self.stats.preemptions_total += 1
        log.info("preempted (will recompute)", extra={"request_id": seq.request_id})

    @staticmethod
    def _emit(seq: Sequence, out: SeqOutput) -> None:
        if seq.sink is not None:
            seq.sink(out)

    # ---- the prefix cache as the KV event stream sees it (worker/server/kv_events.py) -----------

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash this engine caches, as its on_kv_event calls have told so far."""
        with self.lock:
            return self.allocator.cached_hashes()

    def _publish_kv_events(self) -> None:
        """Called by self.lock as its outermost holder lets go: the cache's changes, one call."""
        stored, removed = self.allocator.take_events()
        if stored or removed:
            self.on_kv_event(stored, removed)

    # ---- views ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def outstanding_prompt_tokens(self) -> int:
        with self.lock:
            seqs = list(self.scheduler.waiting) + self.scheduler.running
            return sum(s.num_pending for s in seqs if s.num_pending > 1)
