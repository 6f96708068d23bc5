"""`tandem worker`: run one model worker (prefill, decode or colocated) behind the internal HTTP API.

The HTTP server starts first (so /health answers while a large model loads), then the model and
the KV transport; /ready turns 200 when both are up. Settings come from flags, a YAML file whose
keys mirror the flags (`--config`, mounted by the operator), and POD_NAME / POD_IP / TANDEM_KV_COMPAT;
the internal secret from $TANDEM_INTERNAL_SECRET or --internal-secret-file, never from a flag.
Imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from tandem.contracts import timing
from tandem.contracts.model_support import ModelBackend
from tandem.contracts.names import KVBackend, Role
from tandem.worker.server.config import WorkerConfig
from tandem.worker.vllm import launch as vllm_launch

ROLES = tuple(r.value for r in Role)
BACKENDS = tuple(b.value for b in KVBackend)


class _RefuseSecretOnArgv(argparse.Action):
    """`--internal-secret VALUE` would otherwise be taken as an abbreviation of --internal-secret-file."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error("the internal secret is never a flag (argv is world-readable): set "
                     "$TANDEM_INTERNAL_SECRET or --internal-secret-file")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    # Every default is None here so a flag given on the command line wins over --config, and
    # the config file wins over WorkerConfig's defaults.
    a("--config", help="YAML file whose keys mirror these flags (dashes or underscores)")
    a("--role", choices=ROLES, default=None, help="prefill, decode or colocated (default)")
    a("--model", default=None, help="Hugging Face model folder (or a hub id with HF_HOME holding a cache)")
    a("--host", default=None, help="address to listen on (default 0.0.0.0)")
    a("--port", type=int, default=None, help="port to listen on (default 8000; 0 picks a free one)")
    a("--advertise-url", default=None, help="base URL peers use to reach this worker "
      "(default http://$POD_IP:PORT, else the listen host)")
    a("--dtype", default=None, choices=("auto", "float32", "float16", "bfloat16"))
    a("--device", default=None, help="auto (default), cpu, cuda or cuda:N")
    a("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: from --kv-memory-fraction)")
    a("--kv-memory-fraction", type=float, default=None, help="fraction of free memory for the KV pool")
    a("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    a("--max-num-seqs", type=int, default=None, help="running sequences at most (default 64)")
    a("--max-waiting", type=int, default=None, help="requests queued for a seat at most; one more is "
      "answered 429 with Retry-After (default 2 x --max-num-seqs)")
    a("--max-batched-tokens", type=int, default=None, help="tokens per forward pass (default 2048)")
    a("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    a("--prefill-chunk-tokens", type=int, default=None, help="prompt tokens prefilled per step, all "
      "prompts together: running streams wait at most one chunk (default 256 for colocated and decode, "
      "--max-batched-tokens for prefill)")
    a("--prefill-stall-factor", type=float, default=None, help="a step that prefills beside decoding "
      "streams lasts at most this many ordinary steps: its chunk is sized from measured step times, within "
      "--prefill-chunk-tokens (default 2 for decode, off for colocated and prefill; 0: fixed chunks)")
    a("--flow-chunk-tokens", type=int, default=None, help="while a tenant (fairness id) served less lately "
      "had a request here in the last 5 s, the prompt tokens per step of the tenants served more, all "
      "together: a step in flight when its next prompt arrives is that short (default 32; 0: no cap)")
    a("--compile", choices=("auto", "on", "off"), default=None, help="torch.compile the decode step at "
      "start-up (default auto: on a CPU with a C++ compiler; never for --role prefill)")
    a("--model-backend", choices=tuple(b.value for b in ModelBackend), default=None, help="the forward pass: "
      "transformers (the model's own classes with paged attention), or auto (default: the same)")
    a("--prefix-caching", action=argparse.BooleanOptionalAction, default=None, help="keep KV blocks after "
      "their request and start prompts that share a prefix from them (default on)")
    a("--kv-backend", choices=BACKENDS, default=None,
      help="KV transfer backend (default nixl for prefill/decode, none for colocated)")
    a("--kv-timeout-s", type=float, default=None, help=f"a KV pull that takes longer fails (default {timing.KV_TRANSFER_TIMEOUT_S:g})")
    a("--kv-reserve-wait-s", type=float, default=None, help="decode: a handoff waits this long for free "
      f"KV blocks, then answers 503 with Retry-After (default {timing.KV_RESERVE_WAIT_S:g})")
    a("--prefill-queue-s", type=float, default=None, help="a prefill still queued after this is answered "
      f"429 with Retry-After, well before the router's prefill timeout (default {timing.PREFILL_QUEUE_S:g})")
    a("--engine-stall-s", type=float, default=None, help="an engine thread without progress this long "
      "(or dead) turns /health and /ready to 503 (default 120)")
    a("--kv-lease-s", type=float, default=None,
      help=f"prefill: free unpulled KV blocks after this (default {timing.KV_LEASE_S:g})")
    a("--kv-port", type=int, default=None, help="tcp KV backend: the port prefill serves KV on "
      "(default 5601; 0 picks a free one)")
    a("--kv-verify", action=argparse.BooleanOptionalAction, default=None, help="digest every KV block "
      "handed out and check every pull against the digests; KV that differs is recomputed, never served "
      "(default on; off saves the digests' cost, worker/kv/README.md)")
    a("--internal-secret-file", default=None, help="file holding the service's internal secret (a mounted "
      "Secret; default: $TANDEM_INTERNAL_SECRET). Required by /internal/* and the KV port when set")
    a("--internal-secret", action=_RefuseSecretOnArgv, help=argparse.SUPPRESS)
    a("--drain-s", type=float, default=None, help="on SIGTERM: stop being ready, then wait this long at "
      "most for running sequences to finish and leased KV to be pulled (default 30)")
    a("--migrate-on-drain", action=argparse.BooleanOptionalAction, default=None, help="on SIGTERM: hand "
      "running sequences to other decode workers (their KV pulled from here; the router carries each "
      "stream over) instead of waiting for them to finish (default on for decode, needs a kv backend)")
    a("--heartbeat-s", type=float, default=None, help="a generate stream silent this long (a queued "
      f"request) gets a keep-alive line, so the router does not take it for a hang (default {timing.HEARTBEAT_S:g})")
    a("--tensor-parallel", type=int, default=None, metavar="N", help="ranks (one process per device) that "
      "share the model: weights, attention heads and KV cache split N ways. Alone on a node this process "
      "is rank 0 and starts the others (default 1)")
    a("--rank", type=int, default=None, metavar="K", help="a group spanning nodes: this process's rank, the "
      "first of its node (default $LWS_WORKER_INDEX x N / $LWS_GROUP_SIZE)")
    a("--local-ranks", type=int, default=None, metavar="L", help="a group spanning nodes: ranks on this "
      "node, this process and L-1 it starts (default N / $LWS_GROUP_SIZE, else 1)")
    a("--leader-address", default=None, metavar="HOST:PORT", help="where rank 0 listens for the other ranks "
      "(default $LWS_LEADER_ADDRESS, port 29500; unset: a group on this node)")
    a("--tp-timeout-s", type=float, default=None, help="a wait between the ranks longer than this fails "
      "the group (default 60)")
    a("--threads", type=int, default=None, help="torch.set_num_threads")
    a("--served-name", default=None, help="model name in /v1/models (default: the folder's name)")
    a("--kv-compat", default=None, help="tandem.dev/kv-compat (default $TANDEM_KV_COMPAT)")
    a("--log-format", choices=("text", "json"), default=None)
    a("--log-level", default=None, choices=("debug", "info", "warning", "error"))
    vllm_launch.add_arguments(parser)  # --runtime vllm and its own few flags


def resolve_settings(args: argparse.Namespace) -> WorkerConfig:
    """Flags over the config file over WorkerConfig's defaults; ValueError for a bad or unknown key."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        import yaml

        with open(args.config) as f:
            doc = yaml.safe_load(f) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{args.config}: expected a mapping of settings")
        values = {str(k).replace("-", "_"): v for k, v in doc.items()}
    source = args.config or "flags"
    known = {f.name for f in dataclasses.fields(WorkerConfig)}
    flags = {k: v for k, v in vars(args).items() if k in known and v is not None}
    if flags:
        source = f"{source} and flags" if values else "flags"
    return WorkerConfig.from_values(values | flags, source)


def engine_identity() -> tuple[str, str]:
    """(engine_id, epoch): a restarted worker gets a new engine_id, so peers drop stale metadata."""
    import secrets
    import socket
    import time

    epoch = f"{int(time.time())}{secrets.token_hex(3)}"
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}-{epoch}", epoch


def advertise_url(cfg: WorkerConfig, port: int) -> str:
    if cfg.advertise_url:
        return cfg.advertise_url.rstrip("/")
    host = os.environ.get("POD_IP") or cfg.host
    if host in ("0.0.0.0", "::", ""):
        import socket

        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def serve(cfg: WorkerConfig) -> int:
    """Boot, ready, run until SIGTERM, drain, stop (worker/server/runtime.py); the exit status."""
    import logging

    from tandem.worker.engine.errors import ModelLoadError
    from tandem.worker.engine.loader import check_before_loading
    from tandem.worker.server.runtime import StartupError, WorkerRuntime

    log = logging.getLogger("tandem.worker")
    try:
        check_before_loading(cfg.model, cfg.model_backend.value, cfg.tensor_parallel)
    except ModelLoadError as e:
        log.error("cannot start the engine: %s", e)
        return 1
    if cfg.internal_secret is None:
        log.warning("no internal secret ($TANDEM_INTERNAL_SECRET or --internal-secret-file): /internal/* "
                    "and the KV transfer accept anyone who can reach this worker")
    engine_id, _ = engine_identity()
    runtime = WorkerRuntime(cfg, engine_id, advertise_url=lambda port: advertise_url(cfg, port))
    try:
        await runtime.boot()
        try:
            await runtime.ready()
        except StartupError as e:
            log.error("%s", e)
            return 1
        await runtime.until_stopped()
        await runtime.drain()
        return 0
    finally:
        await runtime.stop()


def run(args: argparse.Namespace) -> int:
    if vllm_launch.wants_vllm(args):
        return vllm_launch.run(args)
    import asyncio
    import logging
    import sys

    from tandem.contracts.logs import configure_logging

    try:
        cfg = resolve_settings(args)
    except (OSError, ValueError) as e:
        print(f"tandem worker: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log_format, cfg.log_level)
    if cfg.log_format == "json":
        # Keep stderr one JSON object per line: no tqdm bars from weight loading.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Compiled decode steps are cached across restarts (inductor keys them by torch version and
    # code): a worker's second start takes seconds, not a minute. The image sets its own.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          str(Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "inductor"))
    logging.getLogger("tandem.worker").info("starting worker", extra={"settings": cfg.public()})
    if cfg.placement.rank > 0:  # a follower rank of a tensor-parallel group: no HTTP API of its own
        from tandem.worker.engine.parallel.follower import run_follower
        from tandem.worker.engine.parallel.group import leave_process

        leave_process(run_follower(cfg))  # the group is closed; skip finalising its native threads
    return asyncio.run(serve(cfg))
