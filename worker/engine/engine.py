"""The engine: a model, one paged KV pool, a scheduler, and the step that ties them together.

`Engine` is synchronous and owns all sequence state (guarded by one lock); `AsyncEngine`
(async_engine.py) runs its steps on a dedicated thread for the HTTP server. Tests and benchmarks
drive `Engine` directly.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tandem.contracts.protocol import FinishReason, GenerateRequest, SamplingParams
from tandem.worker.engine.admission import Admission
from tandem.worker.engine.batch import run_batch
from tandem.worker.engine.block_allocator import BlockAllocator
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.decode_step import prepare_kernels
from tandem.worker.engine.detokenizer import IncrementalDetokenizer
from tandem.worker.engine.errors import ModelLoadError, RequestError
from tandem.worker.engine.grammar import GrammarCompiler
from tandem.worker.engine.leases import Lease, LeaseKeeping
from tandem.worker.engine.loader import LoadedModel, load_model
from tandem.worker.engine.migration import Migration
from tandem.worker.engine.paged_forward import BatchItem, kv_layout_for, model_runner
from tandem.worker.engine.prefix_cache import PrefixCache, PublishingLock, prefix_salt
from tandem.worker.engine.scheduler import ScheduledChunk, Scheduler
from tandem.worker.engine.sequence import SeqOutput, SeqStatus, Sequence
from tandem.worker.engine.validation import check_sampling, generated_ids, tokenize
from tandem.worker.engine.weights import model_weights

log = logging.getLogger("tandem.worker.engine")


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    steps_total: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    # Tokens run through the model other than one per decode step: prompts prefilled here, and
    # sequences recomputed (after a preemption, or resumed without their KV).
    prefill_tokens_computed_total: int = 0
    # Sequences handed out by a draining engine: "kv" with their KV leased, "recompute" without.
    migrated_out: dict[str, int] = field(default_factory=dict)


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pool_blocks(config: EngineConfig, lm: LoadedModel) -> int:
    """The KV pool's size in blocks: num_blocks, or what kv_memory_fraction of the free memory holds
    (a tensor-parallel rank's blocks hold its heads only: lm.group)."""
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        probe = kv_layout_for(lm.config, 1, config.block_size, lm.dtype, lm.group)
        default_fraction = 0.9 if lm.device.type == "cuda" else 0.25
        fraction = config.kv_memory_fraction or default_fraction
        num_blocks = int(_available_memory(lm.device) * fraction) // probe.block_bytes
        # On a CPU there is no point in more than every sequence at full context.
        if lm.device.type == "cpu" and config.kv_memory_fraction is None:
            num_blocks = min(num_blocks, config.max_num_seqs * probe.blocks_for(lm.max_model_len))
    if num_blocks < 1:
        raise ModelLoadError("no memory left for the KV pool; lower kv_memory_fraction or set num_blocks")
    return num_blocks


class Engine(Admission, LeaseKeeping, Migration):
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, lease_s: float = 30.0):
        if config.threads:
            torch.set_num_threads(config.threads)
        if config.block_size < 1 or config.max_num_seqs < 1 or config.max_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_batched_tokens must be >= 1")
        if config.prefill_chunk_tokens is not None and config.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1 (or unset: max_batched_tokens)")
        if config.max_waiting is not None and config.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0 (or unset: 2 x max_num_seqs)")
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
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        self.served_name = config.served_name or lm.name
        num_blocks = pool_blocks(config, lm)
        self.layout = kv_layout_for(lm.config, num_blocks, config.block_size, lm.dtype, lm.group)
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
        self.runner = model_runner(weights, self.pool, self.layout, kernels)
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
        self.max_waiting = config.max_waiting if config.max_waiting is not None else 2 * config.max_num_seqs
        self._claims: set[str] = set()  # request ids of handoffs being pulled: queued, not added yet
        self.stats = EngineStats()
        self.on_step: Callable[[float, int], None] = lambda seconds, num_tokens: None
        # Called when blocks come back from outside the step (a lease released, a pull given up),
        # so a step loop waiting for free blocks wakes up.
        self.on_blocks_freed: Callable[[], None] = lambda: None
        self._in_flight: set[str] = set()
        self._abort_after_step: set[str] = set()
        self._migrating = False  # draining: every sequence leaves at the start of the next step

    # ---- requests in ----------------------------------------------------------------------

    def tokenize(self, req: GenerateRequest) -> list[int]:
        return tokenize(self.tokenizer, req, self.vocab_size)

    def validate_sampling(self, p: SamplingParams) -> None:
        check_sampling(p, self.vocab_size)

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
        resumed = generated_ids(req, self.vocab_size)
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
            stop_ids=frozenset(p.stop_token_ids),
        )
        seq.detok = IncrementalDetokenizer(self.tokenizer, prompt, p.stop)
        if p.structured is not None:
            seq.grammar = self.grammars.compile(p.structured)
        self._replay(seq, resumed, req.emitted_chars)
        return seq

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
            out = self._aborted(seq)
        self._emit(seq, out)
        return True

    def _aborted(self, seq: Sequence) -> SeqOutput:
        self._finish(seq, FinishReason.ABORT)
        return SeqOutput(seq.request_id, text=self._final_text(seq), finished=True,
                         finish_reason=FinishReason.ABORT)

    # ---- the step ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> int:
        """Run one forward pass over the scheduled batch; returns the number of tokens processed.
        A failure caused by one sequence ends that sequence alone (batch.py). A draining engine
        first hands its sequences out (start_migration)."""
        if self._migrating:
            self._hand_out()
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
            prefill_tokens = sum(c.num_tokens for c in chunks if c.num_tokens > 1 or not c.seq.output_ids)
        results = run_batch(self.runner, chunks, items)
        emits: list[tuple[Sequence, SeqOutput]] = []
        with self.lock:
            self._in_flight = set()
            for c, result in zip(chunks, results, strict=True):
                out = self._advance(c, result)
                if out is not None:
                    emits.append((c.seq, out))
            for rid in self._abort_after_step:
                seq = self.seqs.get(rid)
                if seq is not None:
                    emits.append((seq, self._aborted(seq)))
            self._abort_after_step = set()
            self.stats.steps_total += 1
            self.stats.prefill_tokens_computed_total += prefill_tokens
        n = sum(c.num_tokens for c in chunks)
        self.on_step(time.perf_counter() - t0, n)  # before the outputs: a reader sees its own step
        for seq, out in emits:
            self._emit(seq, out)
        return n

    def _advance(self, c: ScheduledChunk, result: int | None | Exception) -> SeqOutput | None:
        """Under the lock: what one chunk's result does to its sequence; its output, if any."""
        seq = c.seq
        if seq.finished:
            return None
        if isinstance(result, Exception):
            self._finish(seq, FinishReason.ERROR)
            return self._error_output(seq, result)
        seq.num_computed += c.num_tokens
        self.prefix_cache.commit(seq)
        if result is None:
            return None
        try:
            return self._append_token(seq, result)
        except Exception as e:  # noqa: BLE001 - detokenizing or a stop check failed for this sequence
            log.exception("failed to take a token", extra={"request_id": seq.request_id})
            if not seq.finished:
                self._finish(seq, FinishReason.ERROR)
            return self._error_output(seq, e)

    def _append_token(self, seq: Sequence, tok: int) -> SeqOutput:
        """Add a sampled token, apply the stop rules, finish or lease the sequence; under the lock."""
        seq.output_ids.append(tok)
        self.stats.generation_tokens_total += 1
        reason = self._finish_reason(seq, tok)
        out = SeqOutput(seq.request_id, token_ids=[tok])
        if seq.sampled_logprobs is not None:
            out.logprobs, seq.sampled_logprobs = [seq.sampled_logprobs], None
        if reason is not None:
            out.text, out.finished, out.finish_reason = seq.detok.take(final=True), True, reason
            self._finish(seq, reason)
        else:
            out.text = seq.detok.take()
            if seq.prefill_only:
                self.scheduler.running.remove(seq)
                del self.seqs[seq.request_id]
                self._lease(seq)
                out.kv_blocks = list(seq.block_table)
        return out

    @staticmethod
    def _finish_reason(seq: Sequence, tok: int) -> FinishReason | None:
        """The stop rules for `tok`, just appended to seq.output_ids (it also feeds the detokenizer)."""
        p = seq.params
        if (tok in seq.eos_ids and not p.ignore_eos) or tok in seq.stop_ids or seq.detok.add(tok):
            return FinishReason.STOP
        if seq.grammar is not None and seq.grammar.accept(tok):
            return FinishReason.STOP
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= seq.max_total_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.stats.requests_finished[reason.value] = self.stats.requests_finished.get(reason.value, 0) + 1
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.request_id, None)
        self.scheduler.remove(seq)

    @staticmethod
    def _final_text(seq: Sequence) -> str:
        """The text a sequence still holds back, or "" when its detokenizer is what failed."""
        try:
            return seq.detok.take(final=True)
        except Exception:  # noqa: BLE001 - the sequence ends either way
            log.exception("could not detokenize the end of the text", extra={"request_id": seq.request_id})
            return ""

    @staticmethod
    def _error_output(seq: Sequence, error: Exception) -> SeqOutput:
        return SeqOutput(seq.request_id, finished=True, finish_reason=FinishReason.ERROR,
                         error={"message": f"the engine failed on this request: {error}",
                                "type": "internal_error", "param": None, "code": "engine_error"})

    def _on_preempt(self, seq: Sequence) -> None:
        self.stats.preemptions_total += 1
        log.info("preempted (will recompute)", extra={"request_id": seq.request_id})

    @staticmethod
    def _emit(seq: Sequence, out: SeqOutput) -> None:
        if seq.sink is None:
            return
        try:
            seq.sink(out)
        except Exception:  # noqa: BLE001 - one listener's failure must not stop the others' outputs
            log.exception("delivering an output failed", extra={"request_id": seq.request_id})

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

    def idle(self) -> bool:
        """Nothing here that a drain waits for: no sequence, no lease, no handoff being pulled."""
        with self.lock:
            return not (self.seqs or self.leases or self._claims)

    @property
    def num_waiting(self) -> int:
        """Queued for a seat: prompts, pulled handoffs, and handoffs being pulled."""
        return self.scheduler.num_queued + len(self._claims)

    def outstanding_prompt_tokens(self) -> int:
        with self.lock:
            seqs = list(self.scheduler.waiting) + self.scheduler.running
            return sum(s.num_pending for s in seqs if s.num_pending > 1)
