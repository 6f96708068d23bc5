"""`tandem up`: a router and its workers as local processes, serving the OpenAI API on localhost.

Each child runs in its own process group and dies with this process (PR_SET_PDEATHSIG), so
nothing is orphaned. Ctrl-C or SIGTERM stops everything. If the router dies, everything stops
(exit 1); if a worker dies after start-up, `up` reports it and keeps serving through the
others, as the router falls back (prefill gone: decode-side prefill; a decode worker gone: the
others), which is what the fault tests rely on.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from tandem.contracts.internal_auth import SECRET_ENV
from tandem.contracts.model_support import check_model_config
from tandem.contracts.runtimes import Runtime
from tandem.weights.hub import HubError
from tandem.weights.local import is_hub_id, model_folder
from tandem.worker.local.processes import ManagedProcess, Supervisor, free_port

# what `tandem up` builds when no --model is given: a bit bigger than the tests' model, still
# quick on a CPU
DEFAULT_TOY = {
    "num_layers": 4,
    "hidden_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "seed": 0,
}
TOY_SERVED_NAME = "toy-llama"
TOY_VERSION = 1  # bump when make_toy_model's output for the same arguments changes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a Hugging Face model folder, or a hub id org/name[@revision] "
                        "(downloaded once into the Hugging Face cache; HF_ENDPOINT, HF_TOKEN) (default: a small toy Llama, "
                        "built once under ~/.cache/tandem/models/)")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    parser.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    parser.add_argument("--runtime", choices=[r.value for r in Runtime], default=Runtime.TANDEM.value,
                        help="the workers' engine: tandem (default) or vllm (vLLM servers paired by its "
                        "NixlConnector, installed once under ~/.cache/tandem/; they take a minute or two to start)")
    parser.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=1, metavar="N",
                        help="decode workers; colocated workers in colocated mode (default 1)")
    parser.add_argument("--kv-backend", choices=["nixl", "tcp"], default="nixl",
                        help="how KV moves from prefill to decode (default nixl)")
    parser.add_argument("--tp", type=int, default=None, metavar="N",
                        help="tensor parallelism of every worker: N ranks (processes) each (default 1)")
    parser.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                        help="tensor parallelism of the prefill workers (default --tp)")
    parser.add_argument("--decode-tp", type=int, default=None, metavar="N",
                        help="tensor parallelism of the decode workers, or the colocated ones (default --tp)")
    parser.add_argument("--pin-cpus", action="store_true", help="pin each worker to its own CPU core "
                        "(a worker of several ranks is not pinned)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per worker (default 1)")
    parser.add_argument("--served-name", default=None,
                        help="model name clients send (default: the model folder's name)")
    parser.add_argument("--short-prompt-threshold", type=int, default=None,
                        help="prompts estimated below this many tokens skip prefill (router default)")
    parser.add_argument("--api-key", default=None, help="require this API key (default: env TANDEM_API_KEY)")
    parser.add_argument("--startup-timeout", type=float, default=None,
                        help="seconds to wait for everything to be ready (default 300; 900 with --runtime vllm, "
                        "whose servers compile the model at start-up)")
    parser.add_argument("--state-file", default=None,
                        help="write the processes (name, role, url, pid) here as JSON once ready")
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to every worker (repeatable)")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to the router (repeatable)")


def toy_model_dir() -> Path:
    """The default model, built once and cached by its parameters."""
    key = "llama-" + "-".join(f"{k[:3]}{v}" for k, v in DEFAULT_TOY.items()) + f"-v{TOY_VERSION}"
    path = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "models" / key
    from tandem.worker.local.toy_model import make_toy_model

    if not path.exists():
        print(f"building the toy model once into {path} ...", flush=True)
    return Path(make_toy_model(path, **DEFAULT_TOY))


def processes(args: argparse.Namespace, model: Path, secret: str | None = None) -> list[ManagedProcess]:
    """The processes to start: pure, so the command lines are testable. Every child gets the same
    internal secret (from the environment, never argv): the workers accept only this router."""
    secret = secret or os.environ.get(SECRET_ENV) or secrets.token_urlsafe(32)
    if args.runtime == Runtime.VLLM:
        from tandem.worker.vllm import local as vllm_local

        return vllm_local.processes(args, model, args.served_name or model.name, secret)
    exe = [sys.executable, "-m", "tandem.cli.main"]
    cpus = sorted(os.sched_getaffinity(0)) if args.pin_cpus else []
    children: list[ManagedProcess] = []
    roles = (
        [("colocated", args.decode)]
        if args.mode == "colocated"
        else [("prefill", args.prefill), ("decode", args.decode)]
    )
    for role, count in roles:
        tp = tensor_parallel(args, role)
        for i in range(count):
            port = free_port()
            argv = [
                *exe, "worker", "--role", role, "--model", str(model), "--host", "127.0.0.1",
                "--port", str(port), "--threads", str(args.threads),
                *(["--tensor-parallel", str(tp)] if tp > 1 else []),
                *(["--kv-backend", args.kv_backend] if role != "colocated" else []),
                "--kv-port", "0",  # several workers share this host: each takes a free KV port
                # everything stops together here: a decode worker lets its streams finish instead of
                # migrating them to a peer that is stopping too
                *(["--no-migrate-on-drain"] if role == "decode" else []),
                *(["--served-name", args.served_name] if args.served_name else []),
                *args.worker_arg,
            ]
            cpu = cpus[len(children) % len(cpus)] if cpus and tp == 1 else None
            env = os.environ | {"OMP_NUM_THREADS": str(args.threads), SECRET_ENV: secret}
            children.append(ManagedProcess(f"{role}-{i}", argv, env, f"http://127.0.0.1:{port}", cpu=cpu,
                                           capture=False, role=role))
    router = [*exe, "router", "--host", args.host, "--port", str(args.port)]
    for c in children:
        router += ["--prefill" if c.role == "prefill" else "--decode", c.url]
    if args.short_prompt_threshold is not None:
        router += ["--short-prompt-threshold", str(args.short_prompt_threshold)]
    router += args.router_arg
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    # the key goes through the environment, not argv, where `ps` would show it
    env = os.environ | {SECRET_ENV: secret} | ({"TANDEM_API_KEY": args.api_key} if args.api_key else {})
    children.append(ManagedProcess("router", router, env, f"http://{host}:{args.port}", capture=False,
                                   role="router"))
    return children


def tensor_parallel(args: argparse.Namespace, role: str) -> int:
    """The ranks of one worker of `role`: --prefill-tp / --decode-tp, else --tp, else 1."""
    own = args.prefill_tp if role == "prefill" else args.decode_tp
    return own or args.tp or 1


def _raise_on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class _Refused(Exception):
    """What `tandem up` cannot start with, said to the user (exit 2)."""


def _check_args(args: argparse.Namespace) -> None:
    if args.mode == "disaggregated" and (args.prefill < 0 or args.decode < 1):
        raise _Refused("disaggregated mode needs --decode >= 1 and --prefill >= 0")
    if args.mode == "colocated" and args.decode < 1:
        raise _Refused("colocated mode needs --decode >= 1")
    if any(n is not None and n < 1 for n in (args.tp, args.prefill_tp, args.decode_tp)):
        raise _Refused("--tp, --prefill-tp and --decode-tp must be >= 1")
    if args.startup_timeout is None:
        args.startup_timeout = 900.0 if args.runtime == Runtime.VLLM else 300.0
    if args.api_key is None and os.environ.get("TANDEM_API_KEY"):
        args.api_key = os.environ["TANDEM_API_KEY"]


def _model(args: argparse.Namespace) -> Path:
    """The model folder to serve (built or downloaded once), judged servable from its config.json;
    sets the served name where the folder's own would mislead."""
    try:
        model = model_folder(args.model) if args.model else toy_model_dir()
    except HubError as e:
        raise _Refused(str(e)) from e
    if not args.model and not args.served_name:
        args.served_name = TOY_SERVED_NAME  # friendlier than the cache folder's name
    if args.model and is_hub_id(args.model) and not args.served_name:
        args.served_name = args.model.partition("@")[0]  # not the snapshot folder's commit
    if not (model / "config.json").is_file():
        raise _Refused(f"{model} is not a Hugging Face model folder (no config.json)")
    if args.runtime == Runtime.VLLM:
        return model  # vLLM judges its own models (more than Tandem's engine runs: MLA, ...)
    if (reason := check_model_config(json.loads((model / "config.json").read_text()))) is not None:
        raise _Refused(f"cannot serve {model}: {reason}")
    return model


def _start(args: argparse.Namespace, model: Path, sup: Supervisor, children: list[ManagedProcess]) -> None:
    workers = len(children) - 1
    if args.pin_cpus and workers > len(os.sched_getaffinity(0)):
        print(f"tandem up: {workers} workers on {len(os.sched_getaffinity(0))} cores: "
              "some share a core", file=sys.stderr, flush=True)
    print(f"tandem up: {args.mode}, model {model}", flush=True)
    for c in children:
        sup.start(c)
        pin = f", cpu {c.cpu}" if c.cpu is not None else ""
        log = f", log {c.log_path}" if c.capture else ""
        print(f"  started {c.name:<12} {c.url}  pid {c.pid}{pin}{log}", flush=True)


def _wait_ready(sup: Supervisor, children: list[ManagedProcess], timeout_s: float, t0: float) -> bool:
    """Poll every child's /ready until all answer; False (said on stderr) when one dies or time runs out."""
    pending = list(children)
    last_note = 0.0
    while pending:
        if dead := sup.dead():
            for c in dead:
                print(f"tandem up: {c.name} exited with code {c.returncode} while starting",
                      file=sys.stderr, flush=True)
            return False
        for c in list(pending):
            if c.status(c.ready_path, timeout_s=1.0) == 200:
                c.ready_after = time.monotonic() - t0
                pending.remove(c)
                print(f"  ready   {c.name:<12} after {c.ready_after:.1f}s", flush=True)
        elapsed = time.monotonic() - t0
        if elapsed > timeout_s:
            print(f"tandem up: not ready after {timeout_s:.0f}s: "
                  f"{', '.join(c.name for c in pending)}", file=sys.stderr, flush=True)
            return False
        if pending and elapsed - last_note >= 10:
            last_note = elapsed
            print(f"  waiting for {', '.join(c.name for c in pending)} ({elapsed:.0f}s)", flush=True)
            for c in pending:
                if note := c.waiting_for():
                    print(f"    {c.name}: {note}", flush=True)
        time.sleep(0.25)
    return True


def _announce(args: argparse.Namespace, model: Path, children: list[ManagedProcess]) -> None:
    """The state file (if asked) and the ready banner with a curl to try."""
    router = children[-1]
    if args.state_file:
        state = [{"name": c.name, "role": c.role, "url": c.url, "pid": c.pid} for c in children]
        tmp = Path(args.state_file + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(args.state_file)  # atomic: a reader sees the whole file or none
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    model_name = args.served_name or model.name
    print(
        f"\nTandem is ready at {router.url}/v1 (OpenAI API), model '{model_name}'.\nTry:\n"
        f"  curl -s {router.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", "
        f"\"content\": \"Hello!\"}}], \"max_tokens\": 32}}'\n"
        "Press Ctrl-C to stop.",
        flush=True,
    )


def _watch(sup: Supervisor, children: list[ManagedProcess]) -> int:
    """Serve until the router dies or every worker has (exit 1); a worker's death is only reported."""
    router = children[-1]
    reported: set[str] = set()
    while True:
        for c in sup.dead():
            if c.name in reported:
                continue
            reported.add(c.name)
            if c is router:
                print(f"tandem up: the router exited with code {c.returncode}; stopping",
                      file=sys.stderr, flush=True)
                return 1
            print(f"tandem up: {c.name} exited with code {c.returncode}; "
                  "the router serves through the others", file=sys.stderr, flush=True)
        if len(reported) == len(children) - 1:
            print("tandem up: every worker has exited; stopping", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    sup: Supervisor | None = None
    try:
        _check_args(args)
        signal.signal(signal.SIGTERM, _raise_on_signal)
        model = _model(args)
        children = processes(args, model)
        sup = Supervisor(children)
        t0 = time.monotonic()
        _start(args, model, sup, children)
        if not _wait_ready(sup, children, args.startup_timeout, t0):
            return 1
        _announce(args, model, children)
        return _watch(sup, children)
    except _Refused as e:
        print(f"tandem up: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntandem up: stopping ...", flush=True)
        return 0
    finally:
        if sup is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            sup.stop()
            print("tandem up: stopped", flush=True)
