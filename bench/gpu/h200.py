"""Colocated against disaggregated on ONE GPU: a random-initialised Llama-3.1-8B shape in bf16.

Self-contained (torch only, no transformers, no download, no tandem worker): a minimal Llama
forward pass (RMSNorm, RoPE, GQA attention through SDPA, SwiGLU), greedy sampling, a contiguous
per-sequence KV cache, continuous batching. Three processes share the GPU:

  colocated   one process: a waiting prompt is prefilled between two decode steps (one prefill
              per iteration), so every running sequence waits for that prefill (the stall).
  prefill     the disaggregated pair, two processes on the same GPU: the prefill process computes
  decode      the prompt's KV, copies it into a staging buffer that the decode process allocated
              and shared (CUDA IPC: the "handoff", device-to-device), then the decode process
              copies it into its batch and streams the tokens.

What a single-GPU disaggregation measures, and what it does not: the two processes time-slice
the one GPU (no MPS), so a decode step can run between the prefill process's kernels instead of
after the whole prefill; prefill and decode still take turns on the same SMs and HBM. It does
NOT give decode its own GPU (no added capacity), and its handoff is an intra-GPU copy, not a
network transfer; the script also reports what the same bytes would take at 42.6 GB/s (NIXL
over one 400 Gb/s NIC). Prompts are random token ids (no tokenizer needed); no EOS, every
request generates exactly its output length.

    python3 -m bench.gpu.h200 OUTDIR [--budget-s 420]          (from the repository root)
    python3 -m bench.gpu.h200 OUTDIR --shape tiny --device cpu  (a CPU smoke test of the logic)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B: 8.0B parameters, 128 KiB of bf16 KV per token.
    "llama-3.1-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, inter=14336, vocab=128256,
                         rope_theta=500000.0),
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, inter=256, vocab=1000, rope_theta=10000.0),
}
NIC_BYTES_PER_S = 42.6e9  # NIXL/UCX on one 400 Gb/s NIC (docs/reference)


# --------------------------------------------------------------------------- model (workers only)

class Llama:
    """Random weights (seeded: every process builds the same model) and the two forward passes."""

    def __init__(self, cfg: dict[str, Any], device: str, dtype: Any, seed: int, max_len: int):
        import torch

        self.t = torch
        self.cfg, self.device, self.dtype = cfg, device, dtype
        h, nh, kvh, inter = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["inter"]
        self.H, self.KV, self.D = nh, kvh, h // nh
        self.G = nh // kvh
        g = torch.Generator(device=device)
        g.manual_seed(seed)

        def w(*shape: int) -> Any:
            return torch.randn(*shape, generator=g, device=device, dtype=dtype).mul_(0.02)

        self.embed = w(cfg["vocab"], h)
        self.wqkv = [w((nh + 2 * kvh) * self.D, h) for _ in range(cfg["layers"])]
        self.wo = [w(h, nh * self.D) for _ in range(cfg["layers"])]
        self.wgu = [w(2 * inter, h) for _ in range(cfg["layers"])]
        self.wd = [w(h, inter) for _ in range(cfg["layers"])]
        self.norm_w = torch.ones(h, device=device, dtype=dtype)
        self.lm_head = w(cfg["vocab"], h)
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, self.D, 2, device=device).float() / self.D))
        ang = torch.outer(torch.arange(max_len, device=device).float(), inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)

    def _norm(self, x: Any) -> Any:
        xf = x.float()
        return (xf * self.t.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(self.dtype) * self.norm_w

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = self.D // 2
        rot = self.t.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def _mlp(self, x: Any, layer: int) -> Any:
        import torch.nn.functional as F

        gate, up = (self._norm(x) @ self.wgu[layer].t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.wd[layer].t()

    def prefill(self, ids: Any, k_dst: Any, v_dst: Any) -> int:
        """One prompt; its K/V land in k_dst/v_dst [layers, KV, >=T, D]. Returns the first token."""
        import torch.nn.functional as F

        T = ids.numel()
        H, KV, D = self.H, self.KV, self.D
        x = self.embed[ids]
        cos, sin = self.cos[:T], self.sin[:T]
        for layer in range(self.cfg["layers"]):
            q, k, v = (self._norm(x) @ self.wqkv[layer].t()).split([H * D, KV * D, KV * D], dim=-1)
            q = self._rope(q.view(T, H, D).transpose(0, 1), cos, sin)
            k = self._rope(k.view(T, KV, D).transpose(0, 1), cos, sin)
            v = v.view(T, KV, D).transpose(0, 1)
            k_dst[layer, :, :T] = k
            v_dst[layer, :, :T] = v
            # Repeat K/V to every query head so the fused causal kernel applies (cheap next to prefill).
            a = F.scaled_dot_product_attention(q[None], k.repeat_interleave(self.G, 0)[None],
                                               v.repeat_interleave(self.G, 0)[None], is_causal=True)[0]
            x = x + a.transpose(0, 1).reshape(T, H * D) @ self.wo[layer].t()
            x = x + self._mlp(x, layer)
        return int((self._norm(x[-1:]) @ self.lm_head.t()).argmax(-1).item())

    def decode(self, tokens: list[int], lens: list[int], K: Any, V: Any) -> list[int]:
        """One step for the sequences in cache slots 0..B-1 (lens: tokens already cached)."""
        import torch.nn.functional as F

        t = self.t
        B = len(tokens)
        H, KV, D, G = self.H, self.KV, self.D, self.G
        tok = t.tensor(tokens, device=self.device)
        pos = t.tensor(lens, device=self.device)
        Lc = max(lens) + 1
        mask = (t.arange(Lc, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        bidx = t.arange(B, device=self.device)
        x = self.embed[tok]
        for layer in range(self.cfg["layers"]):
            q, k, v = (self._norm(x) @ self.wqkv[layer].t()).split([H * D, KV * D, KV * D], dim=-1)
            q = self._rope(q.view(B, H, D), cos, sin)
            k = self._rope(k.view(B, KV, D), cos, sin)
            K[layer][bidx, :, pos] = k
            V[layer][bidx, :, pos] = v.view(B, KV, D)
            # GQA for one query token: the G query heads of a KV head are G "positions" of it.
            a = F.scaled_dot_product_attention(q.view(B, KV, G, D), K[layer, :B, :, :Lc],
                                               V[layer, :B, :, :Lc], attn_mask=mask)
            x = x + a.reshape(B, H * D) @ self.wo[layer].t()
            x = x + self._mlp(x, layer)
        return (self._norm(x) @ self.lm_head.t()).argmax(-1).tolist()


# --------------------------------------------------------------------------- worker processes

def worker_main(role: str, opts: dict[str, Any], inbox: Any, outbox: Any, peer: Any,
                stage_q: Any) -> None:
    """One serving process. Messages in: ("req", rid, ids, max_tokens) / ("seq", ...) / ("free",
    stage) / ("stop",). Out: ("ready",), ("first", rid, t, token, info), ("tokens", t, [(rid, tok)],
    [finished rids]), ("error", text)."""
    try:
        _worker(role, opts, inbox, outbox, peer, stage_q)
    except Exception as e:  # noqa: BLE001 - report to the parent, which prints it
        import traceback

        outbox.put(("error", f"{role}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _worker(role: str, opts: dict[str, Any], inbox: Any, outbox: Any, peer: Any, stage_q: Any) -> None:
    import torch

    torch.set_num_threads(1)
    device, dtype = opts["device"], getattr(torch, opts["dtype"])
    cfg = SHAPES[opts["shape"]]
    max_len, S, n_stage = opts["max_len"], opts["max_seqs"], opts["stages"]
    torch.set_grad_enabled(False)
    model = Llama(cfg, device, dtype, opts["seed"], max_len)
    L, KV, D = cfg["layers"], model.KV, model.D
    esize = torch.finfo(dtype).bits // 8

    def cache(n: int) -> tuple[Any, Any]:
        return (torch.zeros(L, n, KV, max_len, D, device=device, dtype=dtype),
                torch.zeros(L, n, KV, max_len, D, device=device, dtype=dtype))

    K = V = Kst = Vst = Kp = Vp = None
    if role in ("colocated", "decode"):
        K, V = cache(S)
    if role == "decode":
        Kst, Vst = cache(n_stage)
        if device == "cpu":
            Kst.share_memory_()
            Vst.share_memory_()
        stage_q.put((Kst, Vst))  # registered once, like a pool registered with the transfer agent
    if role == "prefill":
        Kst, Vst = stage_q.get()
        Kp, Vp = (x[:, 0] for x in cache(1))
    # Warm-up: kernels, cuBLAS handles, allocator.
    wids = torch.randint(3, cfg["vocab"], (64,), device=device)
    if role == "prefill":
        model.prefill(wids, Kp, Vp)
    else:
        model.prefill(wids, K[:, 0], V[:, 0])
        model.decode([1], [64], K, V)
    _sync(torch, device)
    outbox.put(("ready", role))

    running: list[dict[str, Any]] = []  # slot i of K/V holds running[i]
    waiting: deque = deque()
    free_stages = list(range(n_stage))

    def finish_and_compact(done: list[int]) -> None:
        for i in sorted(done, reverse=True):
            last = len(running) - 1
            if i != last:
                n = running[last]["len"]
                K[:, i, :, :n] = K[:, last, :, :n]
                V[:, i, :, :n] = V[:, last, :, :n]
                running[i] = running[last]
            running.pop()

    def step() -> None:
        out = model.decode([r["last"] for r in running], [r["len"] for r in running], K, V)
        now = time.perf_counter()
        toks, done = [], []
        for i, (r, tok) in enumerate(zip(running, out, strict=True)):
            r["len"] += 1
            r["last"] = tok
            r["n"] += 1
            toks.append((r["rid"], tok))
            if r["n"] >= r["max_tokens"]:
                done.append(i)
        outbox.put(("tokens", now, toks, [running[i]["rid"] for i in done]))
        finish_and_compact(done)

    while True:
        idle = not running and not (waiting and (role != "prefill" or free_stages))
        try:
            msgs = [inbox.get(timeout=1.0)] if idle else []
        except queue.Empty:
            msgs = []
        while True:
            try:
                msgs.append(inbox.get_nowait())
            except queue.Empty:
                break
        for m in msgs:
            if m[0] == "stop":
                return
            if m[0] == "free":
                free_stages.append(m[1])
            else:
                waiting.append(m)
        if role == "prefill":
            if waiting and free_stages:
                _, rid, ids, max_tokens = waiting.popleft()
                stage = free_stages.pop()
                ids_t = torch.tensor(ids, device=device)
                t0 = time.perf_counter()
                first = model.prefill(ids_t, Kp, Vp)  # .item() synchronises
                t1 = time.perf_counter()
                T = len(ids)
                Kst[:, stage, :, :T] = Kp[:, :, :T]
                Vst[:, stage, :, :T] = Vp[:, :, :T]
                _sync(torch, device)
                t2 = time.perf_counter()
                info = {"prefill_s": t1 - t0, "handoff_s": t2 - t1, "kv_bytes": 2 * L * KV * T * D * esize}
                outbox.put(("first", rid, t2, first, info))
                peer.put(("seq", rid, stage, T, first, max_tokens))
            continue
        # colocated and decode: admit, then one decode step.
        if waiting and len(running) < S:
            m = waiting.popleft()
            slot = len(running)
            if m[0] == "req":  # colocated: prefill here, between two decode steps
                _, rid, ids, max_tokens = m
                t0 = time.perf_counter()
                first = model.prefill(torch.tensor(ids, device=device), K[:, slot], V[:, slot])
                now = time.perf_counter()
                outbox.put(("first", rid, now, first, {"prefill_s": now - t0}))
                T = len(ids)
            else:  # decode: take the handed-off KV from the staging buffer into the batch
                _, rid, stage, T, first, max_tokens = m
                K[:, slot, :, :T] = Kst[:, stage, :, :T]
                V[:, slot, :, :T] = Vst[:, stage, :, :T]
                _sync(torch, device)
                peer.put(("free", stage))
            running.append({"rid": rid, "len": T, "last": first, "n": 1, "max_tokens": max_tokens})
            if max_tokens <= 1:
                outbox.put(("tokens", time.perf_counter(), [], [rid]))
                finish_and_compact([len(running) - 1])
        if running:
            step()


# --------------------------------------------------------------------------- the parent: arms and load

class ArmProcs:
    """The processes of one arm and a thread that turns their events into request records."""

    def __init__(self, name: str, ctx: Any, opts: dict[str, Any]):
        from bench.metrics import RequestRecord  # noqa: F401 - fail early if the repo is not on the path

        self.name = name
        self.out = ctx.Queue()
        self.procs = []
        if name == "colocated":
            self.entry = ctx.Queue()
            self.procs.append(ctx.Process(target=worker_main, daemon=True,
                                          args=("colocated", opts, self.entry, self.out, None, None)))
            self.roles = {"colocated"}
            self.inboxes = [self.entry]
        else:
            # Kept on self: a queue the parent drops is unlinked before the children unpickle it.
            self.entry, dq, sq = self.queues = (ctx.Queue(), ctx.Queue(), ctx.Queue())
            self.procs.append(ctx.Process(target=worker_main, daemon=True,
                                          args=("prefill", opts, self.entry, self.out, dq, sq)))
            self.procs.append(ctx.Process(target=worker_main, daemon=True,
                                          args=("decode", opts, dq, self.out, self.entry, sq)))
            self.roles = {"prefill", "decode"}
            self.inboxes = [self.entry, dq]
        self.lock = threading.Lock()
        self.records: dict[int, Any] = {}
        self.infos: dict[int, dict] = {}
        self.tokens: dict[int, list[int]] = {}
        self.on_finish = None
        self.t0 = 0.0
        self.errors: list[str] = []

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def wait_ready(self, timeout: float) -> None:
        ready: set[str] = set()
        deadline = time.monotonic() + timeout
        while ready != self.roles:
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"{self.name}: worker process exited before it was ready ({dead})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: not ready after {timeout:.0f}s")
            try:
                m = self.out.get(timeout=1.0)
            except queue.Empty:
                continue
            if m[0] == "error":
                raise RuntimeError(m[1])
            if m[0] == "ready":
                ready.add(m[1])
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        while True:
            m = self.out.get()
            with self.lock:
                if m[0] == "error":
                    self.errors.append(m[1])
                    print(m[1], file=sys.stderr, flush=True)
                elif m[0] == "first":
                    _, rid, t, tok, info = m
                    r = self.records.get(rid)
                    if r is not None:
                        r.chunk_times_s.append(t - self.t0)
                        self.tokens[rid] = [tok]
                        self.infos[rid] = info
                elif m[0] == "tokens":
                    _, t, toks, done = m
                    for rid, tok in toks:
                        r = self.records.get(rid)
                        if r is not None:
                            r.chunk_times_s.append(t - self.t0)
                            self.tokens[rid].append(tok)
                    for rid in done:
                        r = self.records.get(rid)
                        if r is not None:
                            r.end_s = t - self.t0
                            r.completion_tokens = len(r.chunk_times_s)
                            r.text = " ".join(map(str, self.tokens[rid]))
                            if self.on_finish:
                                self.on_finish(rid)

    def run(self, reqs: list[dict[str, Any]], rate: float | None, concurrency: int | None,
            timeout: float) -> list[Any]:
        """Open loop (Poisson times in reqs[i]["at"]) or closed loop at a concurrency."""
        from bench.metrics import RequestRecord

        done = threading.Event()
        pending = deque(reqs)
        left = [len(reqs)]
        with self.lock:
            self.records, self.infos, self.tokens = {}, {}, {}
            self.t0 = time.perf_counter()

        def send(req: dict[str, Any]) -> None:
            r = RequestRecord(req["index"], len(req["ids"]), req["max_tokens"], scheduled_s=req["at"])
            with self.lock:
                r.send_s = time.perf_counter() - self.t0
                self.records[req["index"]] = r
            self.entry.put(("req", req["index"], req["ids"], req["max_tokens"]))

        def finished(rid: int) -> None:  # called under self.lock by the collector
            left[0] -= 1
            if left[0] == 0:
                done.set()
            elif concurrency and pending:
                nxt = pending.popleft()
                threading.Thread(target=send, args=(nxt,), daemon=True).start()

        self.on_finish = finished
        if concurrency:
            for _ in range(min(concurrency, len(pending))):
                send(pending.popleft())
        else:
            while pending:
                req = pending.popleft()
                delay = self.t0 + req["at"] - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                send(req)
        if not done.wait(timeout):
            print(f"{self.name}: {left[0]} requests unfinished after {timeout:.0f}s", flush=True)
        with self.lock:
            self.on_finish = None
            recs = [self.records[i] for i in sorted(self.records)]
            for r in recs:
                if r.end_s is None:
                    r.error = "unfinished"
            infos = dict(self.infos)
        return recs, infos

    def stop(self) -> None:
        for q in self.inboxes:
            try:
                q.put(("stop",))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def make_requests(n: int, lo: int, hi: int, out_len: int, vocab: int, seed: int,
                  rate: float | None) -> list[dict[str, Any]]:
    from bench.workload import poisson_arrivals, prompt_lengths

    lens = prompt_lengths(lo, hi, n, seed)
    at = poisson_arrivals(rate, n, seed) if rate else [0.0] * n
    out = []
    for i, (length, t) in enumerate(zip(lens, at, strict=True)):
        rng = random.Random(f"gpu-ids-{seed}-{i}")
        out.append({"index": i, "ids": [rng.randrange(3, vocab) for _ in range(length)],
                    "max_tokens": out_len, "at": t})
    return out


def summarize_arm_run(recs: list[Any], infos: dict[int, dict], slos: list[Any]) -> dict[str, Any]:
    from bench.metrics import distribution, summarize

    s = summarize(recs, slos)
    hand = [i["handoff_s"] for i in infos.values() if "handoff_s" in i]
    kvb = [i["kv_bytes"] for i in infos.values() if "kv_bytes" in i]
    s["prefill_compute"] = distribution([i["prefill_s"] for i in infos.values() if "prefill_s" in i])
    if hand:
        s["handoff"] = distribution(hand)
        s["kv_bytes_per_request"] = sum(kvb) / len(kvb)
        s["handoff_GBps"] = sum(kvb) / sum(hand) / 1e9 if sum(hand) > 0 else math.nan
        s["handoff_share_of_ttft"] = (sum(hand) / len(hand)) / s["ttft"]["mean"]
        s["projected_nic_handoff_s"] = s["kv_bytes_per_request"] / NIC_BYTES_PER_S
    return s


def markdown(result: dict[str, Any]) -> str:
    """A table for BENCHMARKS.md: medians over repetitions per (workload, arm), then the ratios."""
    import statistics

    from bench.report import fmt_ratio, fmt_s, md_table

    rows = []
    keys = sorted({(r["workload"], r["arm"]) for r in result["runs"]})
    for w, arm in keys:
        ss = [r["summary"] for r in result["runs"] if r["workload"] == w and r["arm"] == arm]

        def med(f: Any, ss: list[dict] = ss) -> float:
            v = [x for x in (f(s) for s in ss) if x is not None and not math.isnan(x)]
            return statistics.median(v) if v else math.nan

        rows.append([w, arm, f"{med(lambda s: s['throughput_rps']):.2f}",
                     *(fmt_s(med(lambda s, k=k, q=q: s[k][q]))
                       for k, q in (("ttft", "p50"), ("ttft", "p99"), ("itl", "p50"), ("itl", "p99"),
                                    ("itl", "max"), ("tpot", "p50"))),
                     fmt_s(med(lambda s: s.get("handoff", {}).get("p50", math.nan))),
                     str(len(ss))])
    cal = result.get("calibration", {})
    out = [f"{result['env'].get('gpu', 'no GPU')}, torch {result['env'].get('torch')}; "
           f"{result['shape']} {result['dtype']}; prompts {result['prompt_len'][0]}-{result['prompt_len'][1]}, "
           f"{result['output_len']} out; isolated prefill ({cal.get('isolated_prefill_tokens')} tokens) "
           f"{fmt_s(cal.get('isolated_prefill_s'))}, decode step {fmt_s(cal.get('isolated_step_s'))}, "
           f"capacity {cal.get('capacity_rps', math.nan):.2f} req/s; wall {result.get('wall_s', 0):.0f} s.", "",
           md_table(["workload", "arm", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max",
                     "TPOT p50", "handoff p50", "reps"], rows), "",
           md_table(["workload", *(m for m in ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "itl.max",
                                                "tpot.p50", "throughput_rps"))],
                    [[w, *(fmt_ratio(d.get(m)) for m in ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99",
                                                         "itl.max", "tpot.p50", "throughput_rps"))]
                     for w, d in sorted(result.get("ratios_disaggregated_over_colocated", {}).items())]),
           "", f"Greedy output identical in both arms (requests): {result.get('greedy_same_tokens')}", ""]
    return "\n".join(out)


def env_report() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch
    except ImportError:
        print("ERROR: torch is not installed for " + sys.executable + "; install torch (CUDA build) "
              "or run with the interpreter that has it (PYTHON=... run_h200.sh OUTDIR).", flush=True)
        raise SystemExit(2) from None
    info["torch"] = torch.__version__
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = p.name
        info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    try:
        import transformers

        info["transformers"] = transformers.__version__ + " (not used: the model is built here)"
    except ImportError:
        info["transformers"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(2048, 8192))
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="no new repetition starts past this many seconds (the first always runs)")
    p.add_argument("--span-s", type=float, default=15.0, help="an open-loop run lasts about this long")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t_start = time.monotonic()
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    env = env_report()
    print(f"environment: {json.dumps(env)}", flush=True)
    if a.device.startswith("cuda") and not env["cuda_available"]:
        print("ERROR: --device cuda but torch sees no GPU (torch.cuda.is_available() is False).", flush=True)
        return 2

    import torch.multiprocessing as mp

    from bench.metrics import make_slos, percentile, ratio, spread

    cfg = SHAPES[a.shape]
    lo, hi = a.prompt_len
    opts = {"device": a.device, "dtype": a.dtype, "shape": a.shape, "seed": a.seed,
            "max_len": hi + a.output_len + 8, "max_seqs": a.max_seqs, "stages": 2}
    ctx = mp.get_context("spawn")
    arms = {n: ArmProcs(n, ctx, opts) for n in ("colocated", "disaggregated")}
    for arm in arms.values():
        arm.start()
    result: dict[str, Any] = {"env": env, "shape": a.shape, **cfg, "dtype": a.dtype,
                              "prompt_len": [lo, hi], "output_len": a.output_len,
                              "kv_bytes_per_token": 2 * cfg["layers"] * cfg["kv_heads"]
                              * cfg["hidden"] // cfg["heads"] * (2 if a.dtype != "float32" else 4),
                              "what_single_gpu_disaggregation_measures": __doc__.split("\n\n")[2],
                              "runs": []}
    try:
        for arm in arms.values():
            arm.wait_ready(300)
        print(f"arms ready after {time.monotonic() - t_start:.0f}s", flush=True)
        colo = arms["colocated"]
        vocab = cfg["vocab"]
        recs, _ = colo.run(make_requests(2, hi, hi, 1, vocab, 901, None), None, 1, 120)
        prefill_s = min(r.ttft for r in recs if r.ttft is not None)
        recs, _ = colo.run(make_requests(1, lo, lo, 64, vocab, 902, None), None, 1, 120)
        step_s = percentile([g for r in recs for g in r.gaps], 50)
        n_cap = 2 * a.max_seqs
        recs, _ = colo.run(make_requests(n_cap, lo, hi, a.output_len, vocab, 903, None), None, a.max_seqs, 300)
        ok = [r for r in recs if r.ok]
        capacity = len(ok) / (max(r.end_s for r in ok) - min(r.send_s for r in ok))
        result["calibration"] = {"isolated_prefill_s": prefill_s, "isolated_prefill_tokens": hi,
                                 "isolated_step_s": step_s, "capacity_rps": capacity}
        print(f"calibration: {json.dumps(result['calibration'])}", flush=True)
        slos = make_slos(prefill_s, step_s)
        result["slos"] = [s.__dict__ for s in slos]
        rep_s = 0.0
        for rep in range(a.reps):
            # A repetition starts only if one more, as long as the last, ends within the budget.
            if rep > 0 and time.monotonic() - t_start + rep_s > a.budget_s:
                print(f"budget reached: {rep} repetition(s)", flush=True)
                break
            t_rep = time.monotonic()
            for k, frac in enumerate((0.3, 0.6, 0.9)):
                rate = frac * capacity
                n = max(8, min(64, round(rate * a.span_s)))
                reqs = make_requests(n, lo, hi, a.output_len, vocab, 100 * rep + k, rate)
                order = ["colocated", "disaggregated"] if (rep + k) % 2 == 0 else ["disaggregated", "colocated"]
                for name in order:
                    recs, infos = arms[name].run(reqs, rate, None, 90)
                    s = summarize_arm_run(recs, infos, slos)
                    result["runs"].append({"workload": f"interference@{frac:.1f}", "rep": rep, "arm": name,
                                           "rate": rate, "summary": s,
                                           "records": [r.to_dict() for r in recs]})
                    print(f"[{time.monotonic() - t_start:4.0f}s] {frac:.1f} rep {rep} {name}: "
                          f"ttft p50 {s['ttft']['p50']:.3f}s p99 {s['ttft']['p99']:.3f}s | itl p50 "
                          f"{s['itl']['p50'] * 1e3:.1f}ms p99 {s['itl']['p99'] * 1e3:.1f}ms max "
                          f"{s['itl']['max'] * 1e3:.0f}ms | errors {s['errors']}", flush=True)
            rep_s = time.monotonic() - t_rep
    finally:
        for arm in arms.values():
            arm.stop()
    # Ratios disaggregated / colocated per (workload, rep), then median and range.
    base = {(r["workload"], r["rep"]): r["summary"] for r in result["runs"] if r["arm"] == "colocated"}
    per: dict[str, dict[str, list[float]]] = {}
    for r in result["runs"]:
        if r["arm"] != "disaggregated" or (r["workload"], r["rep"]) not in base:
            continue
        b = base[(r["workload"], r["rep"])]
        d = per.setdefault(r["workload"], {})
        for m in ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "itl.max", "tpot.p50", "throughput_rps"):
            k1, k2 = m.split(".") if "." in m else (m, None)
            num = r["summary"][k1][k2] if k2 else r["summary"][k1]
            den = b[k1][k2] if k2 else b[k1]
            d.setdefault(m, []).append(ratio(num, den))
    # Greedy check: the same prompt should give the same token ids in both arms. bf16 kernels
    # with different batch shapes can flip near-ties, so this is reported, not asserted.
    texts = {(r["workload"], r["rep"], r["arm"]): {d["index"]: d["text"] for d in r["records"]}
             for r in result["runs"]}
    result["greedy_same_tokens"] = {
        f"{w}|{rep}": f"{sum(t.get(i) == c[i] for i in c)}/{len(c)}"
        for (w, rep, arm), c in texts.items() if arm == "colocated"
        for t in [texts.get((w, rep, "disaggregated"), {})]}
    print(f"greedy output identical in both arms: {result['greedy_same_tokens']}", flush=True)
    result["ratios_disaggregated_over_colocated"] = {w: {m: spread(v) for m, v in d.items()}
                                                     for w, d in per.items()}
    result["wall_s"] = time.monotonic() - t_start
    from bench.report import json_safe

    path = out / "h200.json"
    path.write_text(json.dumps(json_safe(result), indent=1))
    (out / "h200.md").write_text(markdown(result))
    print(markdown(result), flush=True)
    print(json.dumps(json_safe(result["ratios_disaggregated_over_colocated"]), indent=1))
    print(f"wrote {path} ({result['wall_s']:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    raise SystemExit(main())
