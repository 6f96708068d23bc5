"""The layout of a worker's paged KV pool, shared by the engine and the transfer backends, and which
rank of a tensor-parallel group holds which KV heads.

Each rank's pool is one contiguous tensor allocated once at start-up, shaped
(num_blocks, local_kv_heads, num_layers, 2, block_size, head_dim): a block holds the K and V of
`block_size` tokens for every layer of the rank's KV heads, and within a block each head's part
is one contiguous run of `head_bytes`. So a handoff moves whole blocks by address (adjacent blocks
merge into one larger transfer) between ranks that hold the same heads, and a contiguous slice of
heads of each block between ranks that do not (prefill and decode with different tensor sizes,
as vLLM's NIXL connector needs its "HND" layout for). Block ids are the group's: every rank's
pool has the same blocks, each holding that rank's heads. It imports no torch so the router and
operator can read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def tensor_parallel_problem(num_kv_heads: int, tp: int) -> str | None:
    """Why `tp` ranks cannot share `num_kv_heads` KV heads, or None: each rank holds an equal
    share when tp divides them, or one head (replicated) when tp is a multiple of them."""
    if not isinstance(tp, int) or tp < 1:
        return f"a tensor-parallel size must be an integer >= 1, got {tp!r}"
    if num_kv_heads % tp and tp % num_kv_heads:
        return (f"tensor-parallel size {tp} neither divides the model's {num_kv_heads} KV heads "
                f"nor is a multiple of them")
    return None


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> range:
    """The model's KV heads that `rank` of `tp` holds, in the order of its pool: an equal share
    when tp divides the heads, else one head replicated on tp // num_kv_heads ranks (as vLLM)."""
    if (problem := tensor_parallel_problem(num_kv_heads, tp)) is not None:
        raise ValueError(problem)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {tp}")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def ranks_holding(num_kv_heads: int, tp: int, head: int) -> range:
    """The ranks of a group of `tp` whose pools hold KV head `head`."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(head // per, head // per + 1)
    reps = tp // num_kv_heads
    return range(head * reps, (head + 1) * reps)


@dataclass(frozen=True)
class HeadSlice:
    """`count` consecutive KV heads that one destination rank reads from one source rank:
    heads source_head.. of the source rank's pool into dest_head.. of its own (local indices)."""

    source_rank: int
    source_head: int
    dest_head: int
    count: int


def pull_slices(num_kv_heads: int, source_tp: int, dest_tp: int, dest_rank: int) -> list[HeadSlice]:
    """Where rank `dest_rank` of a group of `dest_tp` finds each KV head it holds in a group of
    `source_tp` that computed them: consecutive heads read from one source rank form one slice.
    A head replicated on several source ranks is read from the one matching the destination rank
    (spreading the reads of replicas over the source ranks)."""
    slices: list[HeadSlice] = []
    for dest_head, head in enumerate(kv_heads_of_rank(num_kv_heads, dest_tp, dest_rank)):
        holders = ranks_holding(num_kv_heads, source_tp, head)
        src = holders[dest_rank % len(holders)]
        src_head = head - kv_heads_of_rank(num_kv_heads, source_tp, src)[0]
        last = slices[-1] if slices else None
        if last and last.source_rank == src and last.source_head + last.count == src_head:
            slices[-1] = HeadSlice(src, last.source_head, last.dest_head, last.count + 1)
        else:
            slices.append(HeadSlice(src, src_head, dest_head, 1))
    return slices


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int  # the model's, across the whole tensor-parallel group
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    tp_size: int = 1  # ranks in this worker's tensor-parallel group
    tp_rank: int = 0  # the rank whose pool this is

    def __post_init__(self) -> None:
        kv_heads_of_rank(self.num_kv_heads, self.tp_size, self.tp_rank)  # raises for a bad group

    @property
    def kv_heads(self) -> range:
        """The model's KV heads this pool holds, in pool order."""
        return kv_heads_of_rank(self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def local_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_blocks, self.local_kv_heads, self.num_layers, 2, self.block_size, self.head_dim)

    @property
    def head_bytes(self) -> int:
        """One KV head's part of a block: K and V of every layer and token, contiguous."""
        return self.num_layers * 2 * self.block_size * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.local_kv_heads * self.head_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def compatible_with(self, other: KVLayout) -> bool:
        """Heads can move between two pools only when the model's KV shape and dtype match (the
        pool sizes and the tensor-parallel groups need not)."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype) == (
            other.num_layers, other.block_size, other.num_kv_heads, other.head_dim, other.dtype)

    def to_dict(self) -> dict:
        return asdict(self)
