"""Engine settings, one dataclass shared by the CLI, the operator's config file and the tests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str  # a Hugging Face model folder or a hub id (needs HF_HOME with a cache)
    # auto | float32 | float16 | bfloat16. auto: the checkpoint's dtype; on a CPU, bf16/fp16
    # checkpoints run in bfloat16 where the CPU has AVX512-BF16 or AMX, else float32 (loader.py)
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV pool size; None: from kv_memory_fraction
    kv_memory_fraction: float | None = None  # of free device memory after loading (CUDA: 0.9, CPU: 0.25)
    max_num_seqs: int = 64  # running sequences at most
    # Sequences that may wait for a seat (new prompts, handoffs being pulled or pulled) beyond the
    # free seats; one more is refused with 429 and Retry-After. None: 2 x max_num_seqs.
    max_waiting: int | None = None
    max_batched_tokens: int = 2048  # tokens in one forward pass (prefill chunks + decode tokens)
    # Prompt tokens one step may prefill, all prompts together: decoding sequences wait at most
    # one such chunk per step. None: max_batched_tokens (the worker sets a per-role default).
    prefill_chunk_tokens: int | None = None
    # A step that prefills beside decoding streams lasts at most this many ordinary decode steps: its
    # chunk is sized from measured step times, within prefill_chunk_tokens (chunk_sizing.py). None:
    # every chunk is prefill_chunk_tokens.
    prefill_stall_factor: float | None = None
    # While a flow (tenant) served less lately is about (scheduler.py FLOW_ACTIVE_S), the prompt tokens
    # one step may prefill of the flows served more, all together: a step in flight when its next
    # prompt arrives is that short. None: no such cap.
    flow_chunk_tokens: int | None = None
    max_model_len: int | None = None  # context length; None: the model's max_position_embeddings
    served_name: str | None = None  # name in /v1/models; None: the model folder's name
    threads: int | None = None  # torch.set_num_threads
    trust_remote_code: bool = False
    # Keep full KV blocks after their sequence ends and start new sequences from the longest
    # cached prefix (prefix_cache.py); off: every prompt is computed whole.
    prefix_caching: bool = True
    # auto | transformers: the forward pass (contracts/model_support.py serving_backend): both are
    # transformers' own classes with the paged attention (the native pass is gone)
    model_backend: str = "auto"
    compile: str = "auto"  # auto | on | off: torch.compile the decode step (auto: on a CPU with a C++ compiler)

    def check(self) -> None:
        """ValueError for settings no engine can run with."""
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_batched_tokens must be >= 1")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1 (or unset: max_batched_tokens)")
        if self.flow_chunk_tokens is not None and self.flow_chunk_tokens < 1:
            raise ValueError("flow_chunk_tokens must be >= 1 (or unset: no cap)")
        if self.prefill_stall_factor is not None and not self.prefill_stall_factor > 1:
            raise ValueError("prefill_stall_factor must be above 1 (or unset: fixed prefill chunks)")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0 (or unset: 2 x max_num_seqs)")
        if self.max_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
