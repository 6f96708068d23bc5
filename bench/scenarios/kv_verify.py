"""What verifying every KV transfer costs (worker/kv/verify.py): the digests per transfer against the
transfer itself, in one run.

    python -m bench kv_verify [--repeats 5]

Layout: the ~42M-parameter benchmark Llama's KV (8 layers, 4 KV heads, head_dim 64, fp32, 16-token
blocks: 16 KiB per token), prompts of 128..8192 tokens. Per prompt, medians of `repeats`: the
prefill side's digests of its leased blocks (crc32: the pool is in host memory), the decode side's
check of the blocks it wrote (the same digests, compared), and a TCP pull of the same blocks from a
KV peer process (kv_handoff's measurement). wsum64, the algorithm for accelerator pools, is timed
on this CPU too for reference; on a GPU it runs as tensor ops on the device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

PROMPTS = [128, 512, 2048, 4096, 8192]


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def digest_costs(layout, repeats: int) -> dict:
    import torch
    from tandem.contracts.kv_source import KVSource
    from tandem.worker.kv.verify import Verdict, block_digests, verify

    pool = torch.randn(layout.shape)
    out: dict = {}
    for n in PROMPTS:
        ids = list(range(1, 1 + layout.blocks_for(n)))  # not from block 0: as a real pull lands
        src = KVSource(url="http://p", engine_id="p", backend="tcp", block_ids=ids, num_tokens=n,
                       digest_algorithm="crc32", digest_heads=layout.num_kv_heads,
                       block_digests=block_digests(pool, ids, "crc32"))
        assert verify(pool, layout, src, ids)[0] is Verdict.VERIFIED
        out[str(n)] = {
            "bytes": len(ids) * layout.block_bytes,
            "prefill_digest_s": _median_s(lambda ids=ids: block_digests(pool, ids, "crc32"), repeats),
            "decode_verify_s": _median_s(lambda ids=ids, src=src: verify(pool, layout, src, ids), repeats),
            "wsum64_on_cpu_s": _median_s(lambda ids=ids: block_digests(pool, ids, "wsum64"), max(1, repeats // 2)),
        }
    return out


async def main_async(a: argparse.Namespace) -> dict:
    import torch
    from tandem.testing.kv_peer import BENCH_LAYOUT

    from bench.scenarios.kv_handoff import bench_backend

    torch.set_num_threads(1)
    layout = BENCH_LAYOUT
    result: dict = {"layout": layout.to_dict(), "bytes_per_token": layout.bytes_per_token, "prompts": PROMPTS,
                    "repeats": a.repeats, "cpu_count": os.cpu_count()}
    result["digests"] = digest_costs(layout, a.repeats)
    result["tcp"] = await bench_backend("tcp", layout, a.repeats, {}, prompts=PROMPTS)
    summary = {}
    for n in PROMPTS:
        d, pull = result["digests"][str(n)], result["tcp"][str(n)]["latency_s"]
        both = d["prefill_digest_s"] + d["decode_verify_s"]
        summary[str(n)] = {
            "MiB": round(d["bytes"] / 2**20, 1),
            "tcp_pull_ms": round(pull * 1e3, 2),
            "prefill_digest_ms": round(d["prefill_digest_s"] * 1e3, 2),
            "decode_verify_ms": round(d["decode_verify_s"] * 1e3, 2),
            "both_over_pull": round(both / pull, 3),
            "crc32_GBps": round(d["bytes"] / d["decode_verify_s"] / 1e9, 2),
            "wsum64_on_cpu_ms": round(d["wsum64_on_cpu_s"] * 1e3, 1),
        }
    result["summary"] = summary
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    result = asyncio.run(main_async(args))
    print(json.dumps(result["summary"], indent=2))
    return result
