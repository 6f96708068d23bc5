"""Every KV transfer verified: one digest per block and KV head, taken where the KV was computed and
again over the blocks a pull wrote, so KV that arrived wrong (a stale block reference, a partial or
garbled transfer) is never served (issue 28 item 11).

The source digests its leased blocks once, as it hands out their KVSource (`block_digests`, one per
block and model KV head: a tensor-parallel source's rank 0 gathers its other ranks' heads from
their rank servers); the puller, after the pull landed and before the sequence is seated,
recomputes the digests of the heads its pool holds over the blocks it wrote and compares count and
values (`verify`; a tensor-parallel puller's other ranks check theirs as they answer their pull). A
mismatch is recomputed by the puller (engine/kv_pull.py) and counted
(tandem_kv_transfer_verify_failures_total). Per head, because within a block each head's part is
one contiguous run (contracts/kv_layout.py) and ranks hold different heads.

Two algorithms (contracts/kv_source.py DIGEST_ALGORITHMS), named in the KVSource, so either side
can check the other's whatever its device:
- crc32 for a pool in host memory: zlib's, over each head's bytes of a block where they lie (no
  copy; zlib lets go of the GIL, so it runs on a worker thread beside the event loop). ~3.5 GB/s a
  core here.
- wsum64 for a pool on an accelerator: sum of w[i] * (2i + 1) mod 2**64 over the run's 32-bit
  words w, a few tensor ops on the device instead of a copy to the host. Any one changed word,
  and any two words swapped, change it.
"""

from __future__ import annotations

import enum
import zlib
from typing import TYPE_CHECKING

from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.kv_source import DIGEST_ALGORITHMS, KVSource

if TYPE_CHECKING:
    import torch

_WSUM_CHUNK_BYTES = 64 << 20  # wsum64 works on this many bytes of blocks at a time (its int64 copy is 2x)


class Verdict(enum.StrEnum):
    VERIFIED = "verified"  # every block's digest matched
    FAILED = "failed"  # a block count or digest differed: the KV must not be served
    SKIPPED = "skipped"  # could not be checked (the detail says why)
    OFF = "off"  # this worker does not verify (--no-kv-verify)


def algorithm_for(pool: torch.Tensor) -> str:
    """The digest a pool on this device computes cheaply."""
    return "crc32" if pool.device.type == "cpu" else "wsum64"


def _runs(pool: torch.Tensor) -> torch.Tensor:
    """The pool as [num_blocks, local heads, head bytes] (a view: the pool is one contiguous tensor
    shaped as KVLayout.shape, each head's part of a block one contiguous run)."""
    import torch

    return pool.view(pool.shape[0], pool.shape[1], -1).view(torch.uint8)


def block_digests(pool: torch.Tensor, block_ids: list[int], algorithm: str) -> list[int]:
    """The digest of each listed block's part of each of the pool's heads, block-major (block i's
    local head j at [i * local heads + j]), by `algorithm` (DIGEST_ALGORITHMS)."""
    if algorithm not in DIGEST_ALGORITHMS:
        raise ValueError(f"unknown digest algorithm {algorithm!r}")
    if not pool.is_contiguous():
        raise ValueError("the KV pool must be one contiguous tensor")
    runs = _runs(pool)
    return _crc32(runs, block_ids) if algorithm == "crc32" else _wsum64(runs, block_ids)


def _crc32(runs: torch.Tensor, block_ids: list[int]) -> list[int]:
    if runs.device.type != "cpu":  # a host-memory source checked by an accelerator's puller
        runs, block_ids = runs[block_ids].cpu(), list(range(len(block_ids)))
    arr = runs.numpy()
    heads = range(arr.shape[1])
    return [zlib.crc32(arr[b, h]) for b in block_ids for h in heads]  # C-contiguous rows: no copy


def _wsum64(runs: torch.Tensor, block_ids: list[int]) -> list[int]:
    import torch

    words = runs.view(torch.int32)
    n = words.shape[2]
    weights = torch.arange(1, 2 * n, 2, dtype=torch.int64, device=words.device)
    step = max(1, _WSUM_CHUNK_BYTES // (8 * n * words.shape[1]))
    out: list[int] = []
    for i in range(0, len(block_ids), step):
        ids = torch.tensor(block_ids[i:i + step], device=words.device)
        sums = (words.index_select(0, ids).to(torch.int64) * weights).sum(dim=2)  # wraps mod 2**64
        out += [v & (1 << 64) - 1 for v in sums.flatten().tolist()]
    return out


def merge(parts: list[tuple[range, list[int]]], num_heads: int, num_blocks: int) -> list[int]:
    """A source's digests over every model head (block-major) from its ranks' own: (the heads a
    rank holds, its block_digests). ValueError when a head has none (a replica's are the same)."""
    out: list[int | None] = [None] * (num_blocks * num_heads)
    for heads, values in parts:
        if len(values) != num_blocks * len(heads):
            raise ValueError(f"{len(values)} digests for {num_blocks} blocks of heads {list(heads)}")
        for i in range(num_blocks):
            for j, h in enumerate(heads):
                out[i * num_heads + h] = values[i * len(heads) + j]
    if any(v is None for v in out):
        raise ValueError(f"no rank's digests for KV heads {sorted({i % num_heads for i, v in enumerate(out) if v is None})}")
    return out  # type: ignore[return-value]


def skip_reason(source: KVSource) -> str | None:
    """Why a pull of `source` cannot be checked; None when it can."""
    if not source.has_digests:
        return ("the source sent no block digests (it runs with --no-kv-verify, predates them, or is a "
                "tensor-parallel worker handing a stream out as it drains)")
    return None


def verify(pool: torch.Tensor, layout: KVLayout, source: KVSource, local_block_ids: list[int]) -> tuple[Verdict, str]:
    """Whether the blocks a pull of `source` wrote into `local_block_ids` hold, for each head this
    pool holds, what the source digested: the verdict and, unless VERIFIED, why."""
    reason = skip_reason(source)
    if reason is not None:
        return Verdict.SKIPPED, reason
    total = source.digest_heads
    if total != layout.num_kv_heads or len(source.block_digests) != len(local_block_ids) * total:
        return Verdict.FAILED, (f"{len(source.block_digests)} digests of {total} heads for "
                                f"{len(local_block_ids)} blocks of {layout.num_kv_heads} heads written")
    got = block_digests(pool, local_block_ids, source.digest_algorithm)
    heads = layout.kv_heads
    bad = sorted({i for i in range(len(local_block_ids)) for j, h in enumerate(heads)
                  if got[i * len(heads) + j] != source.block_digests[i * total + h]})
    if bad:
        return Verdict.FAILED, (f"{len(bad)} of {len(local_block_ids)} blocks differ from the source's "
                                f"{source.digest_algorithm} digests of KV heads {heads.start}-{heads.stop - 1} "
                                f"(positions {bad[:8]})")
    return Verdict.VERIFIED, ""
