"""Which bytes of which pool a pull moves: pure arithmetic over two KV layouts.

A pool's block holds its rank's KV heads one after the other, each head's part contiguous
(tandem.contracts.kv_layout), so moving heads h..h+n of a block is one run of n * head_bytes
bytes on each side; moving every head of two pools that hold the same heads is the whole block,
and consecutive blocks consecutive on both sides merge into one transfer, as before tensor
parallelism. A range is (source offset, destination offset, bytes), offsets into each pool's
storage.
"""

from __future__ import annotations

from tandem.contracts.kv_layout import HeadSlice, KVLayout

Range = tuple[int, int, int]  # (source byte offset, destination byte offset, bytes)


def merge_block_pairs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """[(src_first, dst_first, count), ...]: runs consecutive in both pools become one transfer."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def head_ranges(source: KVLayout, dest: KVLayout, heads: HeadSlice, src_blocks: list[int],
                dst_blocks: list[int]) -> list[Range]:
    """The byte ranges that copy `heads` of src_blocks in the source pool into dst_blocks here,
    adjacent ones merged."""
    if source.head_bytes != dest.head_bytes:
        raise ValueError(f"a KV head is {source.head_bytes} bytes there and {dest.head_bytes} here")
    if heads.source_head + heads.count > source.local_kv_heads or heads.dest_head + heads.count > dest.local_kv_heads:
        raise ValueError(f"{heads} is outside pools of {source.local_kv_heads} and {dest.local_kv_heads} heads")
    hb, n = source.head_bytes, heads.count * source.head_bytes
    ranges: list[Range] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        so = s * source.block_bytes + heads.source_head * hb
        do = d * dest.block_bytes + heads.dest_head * hb
        if ranges and ranges[-1][0] + ranges[-1][2] == so and ranges[-1][1] + ranges[-1][2] == do:
            ranges[-1] = (ranges[-1][0], ranges[-1][1], ranges[-1][2] + n)
        else:
            ranges.append((so, do, n))
    return ranges


def blocks_touched(offset: int, nbytes: int, block_bytes: int) -> range:
    """The blocks a byte range of a pool reads from (what a lease must hold for the read)."""
    return range(offset // block_bytes, (offset + nbytes - 1) // block_bytes + 1)


def overlapping(ranges: list[list[int]]) -> bool:
    """Whether two of these [offset, bytes] ranges share a byte (a read never needs a byte twice)."""
    ordered = sorted(ranges)
    return any(nxt[0] < cur[0] + cur[1] for cur, nxt in zip(ordered, ordered[1:], strict=False))
