"""KV handoff bandwidth and latency, nixl against tcp against raw loopback TCP and memcpy, in one run.

    python -m bench kv_handoff [--repeats 5]

Layout: the ~40M-parameter Llama's KV (8 layers, 4 KV heads, head_dim 64, fp32, 16-token blocks:
16 KiB per token), prompts of 128..8192 tokens. The prefill side is a KV peer process
(tandem.testing.kv_peer), the decode side pulls in this process, as a decode worker does; each
figure is the median of `repeats` pulls after a warm-up (latency includes the completion signal).
Baselines in the same run: memcpy (torch copy of the same bytes) and raw loopback TCP (one
socket, sendall of a memoryview in another process, recv_into here): what the machine allows.
Also measured: idle CPU of a prefill process with and without NIXL's progress thread, and the
handoff's share of time to first token, with prefill compute timed on the same model through
transformers (one thread); finally whether the handoff overlaps with prefill compute at all on
this machine (the question behind layer-wise sending), and TTFT through real `tandem worker`
prefill + decode processes, with the pull's own seconds from the decode worker's metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.lib.handoff import greedy, handoff, worker_client
from bench.lib.processes import BenchProcess, free_port, thread_env, worker_process
from bench.lib.ready import wait_ready
from bench.lib.scrape import read_counters

PROMPTS = [128, 512, 2048, 8192]

_RAW_SENDER = r"""
import socket, sys
n, port = int(sys.argv[1]), int(sys.argv[2]); buf = memoryview(bytearray(n))
srv = socket.create_server(("127.0.0.1", port))
conn, _ = srv.accept()
conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
while True:
    req = conn.recv(8)
    if not req:
        break
    conn.sendall(buf[:int.from_bytes(req, "big")])
"""


def bench_memcpy(torch, nbytes: int, repeats: int) -> float:
    """Median seconds to copy nbytes tensor to tensor (the floor for any handoff on one host)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class RawTcp:
    """Loopback TCP with nothing on top: a sender process, recv_into a preallocated buffer here."""

    def __init__(self, max_bytes: int, log_dir: Path):
        port = free_port()
        self.proc = BenchProcess("raw-tcp-sender", "", "", [sys.executable, "-c", _RAW_SENDER, str(max_bytes), str(port)],
                                 None, log_dir / "raw-tcp-sender.log").start()
        self.sock = self._connect(port)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(max_bytes))

    def _connect(self, port: int, timeout_s: float = 30.0) -> socket.socket:
        """The sender listens once it has started: connect until it does."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return socket.create_connection(("127.0.0.1", port))
            except ConnectionRefusedError:
                if not self.proc.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"raw TCP sender not listening:\n{self.proc.log_tail()}") from None
                time.sleep(0.05)

    def pull(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(nbytes.to_bytes(8, "big"))
        got = 0
        while got < nbytes:
            got += self.sock.recv_into(self.buf[got:nbytes])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.stop(grace_s=10)


def idle_cpu(pid: int, seconds: float = 1.0) -> float:
    """CPU share (1.0 = one core) a process burns while it has nothing to do."""
    import psutil

    p = psutil.Process(pid)
    p.cpu_percent(None)
    time.sleep(seconds)
    return p.cpu_percent(None) / 100


async def _released(prefill, within_s: float = 10.0) -> None:
    """Wait until the prefill process freed every lease (nixl's release arrives asynchronously)."""
    for _ in range(int(within_s / 0.005)):
        if not (await prefill.blocks())["leased"]:
            return
        await asyncio.sleep(0.005)
    raise RuntimeError("the prefill side never released the pulled blocks")


async def bench_backend(backend: str, layout, repeats: int, extra: dict, prompts: list[int] = PROMPTS) -> dict:
    """Median latency and bandwidth of pulls from a prefill process, per prompt length."""
    from tandem.testing.kv_peer import KVPeer, KVPeerProcess
    from tandem.worker.kv.base import KVTransferConfig

    prefill = KVPeerProcess(backend, layout, f"bench-prefill-{backend}-{os.getpid()}", fill=False,
                            extra=extra)
    prefill.start()
    decode = KVPeer(backend, layout, f"bench-decode-{backend}-{os.getpid()}",
                    KVTransferConfig(backend=backend, timeout_s=60, extra=dict(extra)), fill=False)
    await decode.start()
    out: dict = {"idle_cpu_cores_prefill_process": idle_cpu(prefill.proc.pid)}
    try:
        for n in prompts:
            times = []
            for r in range(repeats + 1):
                src = await prefill.prefill(f"{n}-{r}", n, seed=0)
                res = await decode.pull(f"{n}-{r}", src, seed=None)
                assert res["ok"], res
                if r:  # the first is a warm-up (connection set-up, page faults)
                    times.append(res["stats"]["seconds"])
                await _released(prefill)
            nbytes = layout.blocks_for(n) * layout.block_bytes
            med = statistics.median(times)
            out[str(n)] = {"bytes": nbytes, "latency_s": med, "min_latency_s": min(times),
                           "bandwidth_GBps": nbytes / med / 1e9}
        transport = decode.transport.health().transport
        out["health"] = dataclasses.asdict(transport) if transport is not None else None
    finally:
        await decode.close()
        prefill.stop()
    return out


def prefill_seconds(torch, model, n: int) -> float:
    ids = torch.randint(3, model.config.vocab_size, (1, n))
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(ids, use_cache=True)
        return time.perf_counter() - t0


async def overlap_probe(torch, model, layout, n: int) -> dict:
    """Does a handoff overlap with prefill compute here? Time each alone and both at once."""
    from tandem.testing.kv_peer import KVPeer, KVPeerProcess
    from tandem.worker.kv.base import KVTransferConfig

    prefill = KVPeerProcess("nixl", layout, f"ovl-prefill-{os.getpid()}", fill=False)
    prefill.start()
    decode = KVPeer("nixl", layout, f"ovl-decode-{os.getpid()}",
                    KVTransferConfig(backend="nixl", timeout_s=60), fill=False)
    await decode.start()
    try:
        await decode.pull("w", await prefill.prefill("w", n, 0), None)
        t0 = time.perf_counter()
        await decode.pull("a", await prefill.prefill("a", n, 0), None)
        pull_alone = time.perf_counter() - t0
        compute_alone = min(prefill_seconds(torch, model, n) for _ in range(2))
        both, pull_during = float("inf"), float("inf")
        for r in range(2):
            src = await prefill.prefill(f"b{r}", n, 0)
            th = threading.Thread(target=prefill_seconds, args=(torch, model, n))
            t0 = time.perf_counter()
            th.start()
            await decode.pull(f"b{r}", src, None)
            pull_during = min(pull_during, time.perf_counter() - t0)
            await asyncio.to_thread(th.join)
            both = min(both, time.perf_counter() - t0)
    finally:
        await decode.close()
        prefill.stop()
    return {"prompt_tokens": n, "pull_alone_s": pull_alone, "compute_alone_s": compute_alone,
            "pull_while_computing_s": pull_during, "both_concurrently_s": both,
            "sum_of_alone_s": pull_alone + compute_alone,
            "best_case_overlap_saving_s": pull_alone + compute_alone - both}


async def engine_ttft(model_path: Path, backend: str, prompts: list[int], log_dir: Path) -> dict:
    """Through real `tandem worker` processes: prefill time, then decode's wait until it has the KV
    (pull + joining the batch: its stream's START line; its first token line is the request's second
    token), and the pull's own seconds from the decode worker's metrics."""
    from tandem.contracts.protocol import EventType

    flags = ("--block-size", "16", "--drain-s", "1")
    env = os.environ | thread_env(1) | {"UCX_TLS": "tcp"}
    workers = [worker_process(f"{role}-{backend}", role, model_path, log_dir / f"{role}-{backend}.log", None, *flags,
                              kv_backend=backend, num_blocks=640, env=env) for role in ("prefill", "decode")]
    out: dict = {}
    try:
        for w in workers:
            w.start()
        await wait_ready(workers)
        p, d = workers
        async with worker_client() as client:
            for i, n in enumerate([16, *prompts]):
                ids = [0] + [(7 * j) % 30000 + 3 for j in range(n - 1)]
                before = await read_counters([d])
                t0 = time.perf_counter()
                _, t1, s = await handoff(client, p.url, d.url, greedy(ids, 2, request_id=f"{backend}-{n}-{i}"),
                                         until=EventType.START)
                t2 = s.started_s
                pull = (await read_counters([d]) - before).metrics[d.name].get("tandem_kv_transfer_seconds_sum", 0.0)
                if i == 0:
                    continue  # warm-up: connection and metadata set-up
                out[str(n)] = {"prefill_s": t1 - t0, "decode_first_token_s": t2 - t1, "pull_s": pull,
                               "ttft_s": t2 - t0, "pull_share_of_ttft": pull / (t2 - t0)}
    finally:
        for w in workers:
            w.stop()
    return out


def machine_bounds(torch, layout, repeats: int, log_dir: Path) -> dict:
    """What the machine allows for each prompt's bytes: memcpy, and raw loopback TCP."""
    base: dict = {"memcpy": {}, "raw_tcp": {}}
    raw = RawTcp(layout.blocks_for(max(PROMPTS)) * layout.block_bytes, log_dir)
    try:
        for n in PROMPTS:
            nbytes = layout.blocks_for(n) * layout.block_bytes
            raw.pull(nbytes)
            m = bench_memcpy(torch, nbytes, repeats)
            r = statistics.median(raw.pull(nbytes) for _ in range(repeats))
            base["memcpy"][str(n)] = {"latency_s": m, "bandwidth_GBps": nbytes / m / 1e9}
            base["raw_tcp"][str(n)] = {"latency_s": r, "bandwidth_GBps": nbytes / r / 1e9}
    finally:
        raw.close()
    return base


async def main_async(a: argparse.Namespace) -> dict:
    import torch
    from tandem.testing.kv_peer import BENCH_LAYOUT
    from tandem.worker.local.toy_model import make_toy_model

    torch.set_num_threads(1)
    layout = BENCH_LAYOUT
    result: dict = {"layout": layout.to_dict(), "bytes_per_token": layout.bytes_per_token,
                    "prompts": PROMPTS, "repeats": a.repeats, "ucx_tls": os.environ.get("UCX_TLS"),
                    "cpu_count": os.cpu_count()}
    result.update(machine_bounds(torch, layout, a.repeats, Path(a.out_dir)))
    result["nixl"] = await bench_backend("nixl", layout, a.repeats, {})
    result["nixl_progress_thread"] = await bench_backend(
        "nixl", layout, a.repeats, {"nixl_progress_thread": True})
    result["tcp"] = await bench_backend("tcp", layout, a.repeats, {})

    with tempfile.TemporaryDirectory() as d:
        path = make_toy_model(Path(d) / "m40", num_layers=8, hidden_size=512, num_heads=8,
                              num_kv_heads=4, intermediate_size=1536, vocab_size=32000,
                              max_position_embeddings=8192)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        result["model_params"] = sum(p.numel() for p in model.parameters())
        prefill_seconds(torch, model, 64)
        ttft: dict = {}
        for n in PROMPTS:
            if n > a.max_prefill_tokens:
                continue
            p = prefill_seconds(torch, model, n)
            row = {"prefill_compute_s": p}
            for b in ("nixl", "tcp"):
                h = result[b][str(n)]["latency_s"]
                row[f"{b}_handoff_s"] = h
                row[f"{b}_share_of_ttft"] = h / (p + h)
            ttft[str(n)] = row
        result["handoff_share_of_ttft"] = ttft
        result["overlap_probe"] = await overlap_probe(torch, model, layout, 512)
        del model
        if not a.skip_engine:
            small = [n for n in PROMPTS if n <= a.max_prefill_tokens]
            result["engine_ttft"] = {b: await engine_ttft(path, b, small, Path(a.out_dir)) for b in ("nixl", "tcp")}
    summary = {str(n): {
        "nixl_GBps": round(result["nixl"][str(n)]["bandwidth_GBps"], 3),
        "tcp_GBps": round(result["tcp"][str(n)]["bandwidth_GBps"], 3),
        "raw_tcp_GBps": round(result["raw_tcp"][str(n)]["bandwidth_GBps"], 3),
        "memcpy_GBps": round(result["memcpy"][str(n)]["bandwidth_GBps"], 3),
        "nixl_over_raw_tcp": round(result["nixl"][str(n)]["bandwidth_GBps"]
                                   / result["raw_tcp"][str(n)]["bandwidth_GBps"], 3),
        "tcp_over_raw_tcp": round(result["tcp"][str(n)]["bandwidth_GBps"]
                                  / result["raw_tcp"][str(n)]["bandwidth_GBps"], 3),
        "nixl_latency_ms": round(result["nixl"][str(n)]["latency_s"] * 1e3, 2),
        "tcp_latency_ms": round(result["tcp"][str(n)]["latency_s"] * 1e3, 2),
    } for n in PROMPTS}
    result["summary"] = summary
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="skip timing prefill compute above this prompt length (slow on CPU)")
    p.add_argument("--skip-engine", action="store_true",
                   help="skip the end-to-end TTFT through real prefill and decode worker processes")


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("UCX_TLS", "tcp")  # loopback: this process's NIXL agent too
    result = asyncio.run(main_async(args))
    print(json.dumps(result["summary"], indent=2))
    return result
