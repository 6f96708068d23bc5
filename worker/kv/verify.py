"""Every KV transfer verified: one digest per block, taken where the KV was computed and again over
the blocks a pull wrote, so KV that arrived wrong (a stale block reference, a partial or garbled
transfer) is never served (issue 28 item 11).

The source digests its leased blocks once, as it hands out their KVSource (`block_digests`); the
puller, after the pull landed and before the sequence is seated, recomputes them over the blocks it
wrote and compares count and values (`verify`). A mismatch is recomputed by the puller
(engine/kv_pull.py) and counted (tandem_kv_transfer_verify_failures_total).

Two algorithms (contracts/kv_source.py DIGEST_ALGORITHMS), named in the KVSource, so either side
can check the other's whatever its device:
- crc32 for a pool in host memory: zlib's, over each block's bytes where they lie (no copy; zlib
  lets go of the GIL, so it runs on a worker thread beside the event loop). ~3.5 GB/s a core here.
- wsum64 for a pool on an accelerator: sum of w[i] * (2i + 1) mod 2**64 over the block's 32-bit
  words w, a few tensor ops on the device instead of a copy to the host. Any one changed word,
  and any two words swapped, change it.

Not checked (SKIPPED, with the reason logged): tensor-parallel sources or pullers. A rank's pool
holds only its KV heads, so a block's digest would need every rank's share of it, gathered from
processes that only rank 0 of each side talks to; the pull itself is checked per rank as before
(lease, block ranges), the bytes are not.
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


def _blocks(pool: torch.Tensor) -> torch.Tensor:
    """The pool as [num_blocks, block_bytes] bytes (a view: the pool is one contiguous tensor)."""
    import torch

    return pool.view(pool.shape[0], -1).view(torch.uint8)


def block_digests(pool: torch.Tensor, block_ids: list[int], algorithm: str) -> list[int]:
    """The digest of each listed block's bytes, in order, by `algorithm` (DIGEST_ALGORITHMS)."""
    if algorithm not in DIGEST_ALGORITHMS:
        raise ValueError(f"unknown digest algorithm {algorithm!r}")
    if not pool.is_contiguous():
        raise ValueError("the KV pool must be one contiguous tensor")
    blocks = _blocks(pool)
    return _crc32(blocks, block_ids) if algorithm == "crc32" else _wsum64(blocks, block_ids)


def _crc32(blocks: torch.Tensor, block_ids: list[int]) -> list[int]:
    if blocks.device.type != "cpu":  # a host-memory source checked by an accelerator's puller
        blocks, block_ids = blocks[block_ids].cpu(), list(range(len(block_ids)))
    arr = blocks.numpy()
    return [zlib.crc32(arr[b]) for b in block_ids]  # a row of a C-contiguous array: its bytes, no copy


def _wsum64(blocks: torch.Tensor, block_ids: list[int]) -> list[int]:
    import torch

    words = blocks.view(torch.int32)
    n = words.shape[1]
    weights = torch.arange(1, 2 * n, 2, dtype=torch.int64, device=words.device)
    step = max(1, _WSUM_CHUNK_BYTES // (8 * n))
    out: list[int] = []
    for i in range(0, len(block_ids), step):
        ids = torch.tensor(block_ids[i:i + step], device=words.device)
        sums = (words.index_select(0, ids).to(torch.int64) * weights).sum(dim=1)  # wraps mod 2**64
        out += [v & (1 << 64) - 1 for v in sums.tolist()]
    return out


def skip_reason(source: KVSource, layout: KVLayout) -> str | None:
    """Why a pull of `source` into a pool of `layout` cannot be checked; None when it can."""
    if source.tensor_parallel > 1 or layout.tp_size > 1:
        return ("tensor-parallel KV is not verified: each rank's pool holds only its KV heads, so a "
                f"block's digest needs every rank's share (source ranks {source.tensor_parallel}, "
                f"puller ranks {layout.tp_size})")
    if not source.has_digests:
        return "the source sent no block digests (it runs with --no-kv-verify, or predates them)"
    return None


def verify(pool: torch.Tensor, layout: KVLayout, source: KVSource, local_block_ids: list[int]) -> tuple[Verdict, str]:
    """Whether the blocks a pull of `source` wrote into `local_block_ids` hold what the source
    digested: the verdict and, unless VERIFIED, why."""
    reason = skip_reason(source, layout)
    if reason is not None:
        return Verdict.SKIPPED, reason
    if len(source.block_digests) != len(local_block_ids):
        return Verdict.FAILED, (f"{len(source.block_digests)} digests for {len(local_block_ids)} blocks "
                                "written")
    got = block_digests(pool, local_block_ids, source.digest_algorithm)
    bad = [i for i, (a, b) in enumerate(zip(source.block_digests, got, strict=True)) if a != b]
    if bad:
        return Verdict.FAILED, (f"{len(bad)} of {len(got)} blocks differ from the source's "
                                f"{source.digest_algorithm} digests (positions {bad[:8]})")
    return Verdict.VERIFIED, ""
