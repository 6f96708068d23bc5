"""The layout of a worker's paged KV pool, shared by the engine and the transfer backends.

The pool is one contiguous tensor allocated once at start-up, shaped
(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim): a block holds
the K and V of `block_size` tokens for every layer in one contiguous run of
`block_bytes`, so a handoff moves whole blocks by address (adjacent blocks
merge into one larger transfer) and the pool is registered with the transfer
agent once. It imports no torch so the router and operator can read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def compatible_with(self, other: KVLayout) -> bool:
        """Blocks can move between two pools only when everything but their count matches."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype) == (
            other.num_layers, other.block_size, other.num_kv_heads, other.head_dim, other.dtype)

    def to_dict(self) -> dict:
        return asdict(self)

