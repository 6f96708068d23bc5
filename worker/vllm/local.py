"""`tandem up --runtime vllm`: vLLM servers as local processes (a prefill and a decode paired by
vLLM's NixlConnector, KV over UCX on loopback TCP, or colocated servers), each a `tandem worker
--runtime vllm` with ports of its own, and Tandem's router speaking vLLM's protocol to them.

vLLM starts slowly on a CPU (60-90 s here: it imports, loads, then compiles and warms the model),
so each server says, while it starts, which of those steps its log has reached.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from tandem.contracts.internal_auth import SECRET_ENV
from tandem.contracts.runtimes import Runtime
from tandem.worker.local.processes import ManagedProcess, free_port

# What `tandem up` tells the user while a vLLM server starts: the last of these its log shows.
STAGES: tuple[tuple[str, str], ...] = (
    (r"non-default args", "reading its settings"),
    (r"Initializing a V1 LLM engine", "starting its engine process"),
    (r"Starting to load model", "loading the weights"),
    (r"Warming up model for the compilation", "compiling the model (torch.compile: the longest step)"),
    (r"Warming up done", "allocating the KV cache and registering it with NIXL"),
    (r"init engine .* took", "starting its HTTP server"),
    (r"Starting vLLM server on", "answering /health any moment"),
)
# The network KV moves over between local servers (UCX's TCP transport on loopback); an
# environment that sets them wins.
LOCAL_UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def startup_stage(log: str) -> str:
    """The furthest start-up step a vLLM server's log shows (or that it is importing vLLM)."""
    stage = "importing vLLM"
    for pattern, said in STAGES:
        if re.search(pattern, log):
            stage = said
    return stage


class VllmServer(ManagedProcess):
    """A `tandem worker --runtime vllm`: ready when vLLM's /health answers, its log kept in a file
    so start-up can be described (and read after a failure)."""

    ready_path = "/health"
    kv_events = ""  # the ZMQ endpoint its KV events are published on (the router subscribes)

    def waiting_for(self) -> str:
        return f"vLLM: {startup_stage(self.log())}; log {self.log_path}"


def processes(args: argparse.Namespace, model: Path, served: str, secret: str) -> list[ManagedProcess]:
    """The vLLM servers of `args.mode` and the router last; pure but for picking free ports."""
    exe = [sys.executable, "-m", "tandem.cli.main"]
    cpus = sorted(os.sched_getaffinity(0)) if args.pin_cpus else []
    roles = ([("colocated", args.decode)] if args.mode == "colocated"
             else [("prefill", args.prefill), ("decode", args.decode)])
    env = LOCAL_UCX | os.environ
    children: list[VllmServer] = []
    for role, count in roles:
        tp = args.prefill_tp if role == "prefill" else args.decode_tp
        tp = tp or args.tp or 1
        for i in range(count):
            port, events = free_port(), free_port()
            argv = [*exe, "worker", "--runtime", Runtime.VLLM.value, "--role", role, "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(port), "--served-name", served,
                    "--threads", str(args.threads), "--kv-port", str(free_port()), "--kv-events-port", str(events),
                    *(["--tensor-parallel", str(tp)] if tp > 1 else []), *args.worker_arg]
            cpu = cpus[len(children) % len(cpus)] if cpus and tp == 1 else None
            server = VllmServer(f"{role}-{i}", argv, env, f"http://127.0.0.1:{port}", cpu=cpu, role=role)
            server.kv_events = f"tcp://127.0.0.1:{events}"
            children.append(server)
    router = [*exe, "router", "--runtime", Runtime.VLLM.value, "--host", args.host, "--port", str(args.port),
              "--tokenizer", str(model), "--model", served]
    for c in children:
        router += ["--prefill" if c.role == "prefill" else "--decode", c.url, "--kv-events", f"{c.url}={c.kv_events}"]
    if args.short_prompt_threshold is not None:
        router += ["--short-prompt-threshold", str(args.short_prompt_threshold)]
    router += args.router_arg
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    env = os.environ | {SECRET_ENV: secret} | ({"TANDEM_API_KEY": args.api_key} if args.api_key else {})
    return [*children, ManagedProcess("router", router, env, f"http://{host}:{args.port}", capture=False, role="router")]
