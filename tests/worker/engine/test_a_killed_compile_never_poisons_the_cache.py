"""A compile killed mid-way (a deleted pod, Ctrl-C on `tandem up`) left a truncated kernel library in
inductor's shared cache, which inductor takes as built on every later start: the start then ran the
decode step eagerly ("file too short") or mapped the truncated file and could fault past its end
(issue 28.12). The worker sweeps the cache before compiling: a broken object file is removed (under
inductor's own per-kernel lock) and built again. The end-to-end test kills a real compile, then
truncates every library a finished compile left, and starts again each time."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from filelock import FileLock
from tandem.worker.engine.compile_cache import elf_problem, sweep
from tandem.worker.engine.decode_step import compiler_found

needs_compiler = pytest.mark.skipif(compiler_found() is None, reason="torch.compile needs g++ or clang++")


def _library(tmp_path: Path, name: str = "cabc.main.so") -> Path:
    src = tmp_path / "k.c"
    src.write_text("int kernel(int x) { return x * 2; }\nint table[4096] = {1};\n")
    out = tmp_path / name
    subprocess.run([compiler_found(), "-shared", "-fPIC", "-o", str(out), "-x", "c", str(src)], check=True)
    return out


@needs_compiler
def test_a_whole_library_passes_and_every_truncation_is_caught(tmp_path):
    lib = _library(tmp_path)
    assert elf_problem(lib) is None
    data = lib.read_bytes()
    for cut in (0, 10, 64, len(data) // 3, len(data) // 2, len(data) - 1):
        lib.write_bytes(data[:cut])
        assert elf_problem(lib) is not None, f"a file cut at {cut} of {len(data)} bytes passed"
    lib.write_bytes(b"\0" * len(data))  # the linker writes the header last
    assert elf_problem(lib) == "no ELF header"


@needs_compiler
def test_sweep_removes_broken_objects_only_and_leaves_a_build_in_progress(tmp_path):
    root = tmp_path / "cache"
    (root / "ab").mkdir(parents=True)
    whole = shutil.copy(_library(tmp_path), root / "ab" / "cwhole.main.so")
    data = Path(whole).read_bytes()
    broken = root / "ab" / "cbroken.so"
    broken.write_bytes(data[: len(data) // 2])
    building = root / "ab" / "cbuilding.main.so"
    building.write_bytes(data[:100])
    (root / "ab" / "cother.main.cpp").write_text("// source, not an object")
    (root / "locks").mkdir()
    with FileLock(str(root / "locks" / "cbuilding.lock")):  # inductor builds it right now
        assert sweep(root) == [broken]
    assert Path(whole).exists() and building.exists() and not broken.exists()
    assert sweep(root) == [building]  # its build ended without finishing it


_START = textwrap.dedent("""
    import logging, re, sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.engine import Engine
    eng = Engine(EngineConfig(model=sys.argv[1], dtype="float32", num_blocks=32, block_size=16, max_num_seqs=2,
                              max_model_len=128, compile="auto"))
    kernels = eng.runner.kernels
    print("STEP", "compiled" if kernels.enabled and kernels.decode_step is not None else "eager")
    maps = open("/proc/self/maps").read()
    print("MAPPED", " ".join(sorted(set(re.findall(r"(\\S+\\.so)$", maps, re.M)))))
""")


def _start(model: Path, cache: Path) -> tuple[str, list[Path]]:
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _START, str(model)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    mapped = re.search(r"^MAPPED (.*)$", out.stdout, re.M).group(1).split()
    return out.stdout + out.stderr, [Path(p) for p in mapped if p.startswith(str(cache))]


def _kill_during_the_first_build(model: Path, cache: Path) -> None:
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _START, str(model)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            names = {c.name() for c in psutil.Process(proc.pid).children(recursive=True)
                     if c.is_running()}
            if names & {"cc1plus", "ld", "collect2", "as", "g++", "c++"}:
                break
            time.sleep(0.05)
    except psutil.NoSuchProcess:
        pass
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.slow
@needs_compiler
def test_a_killed_compile_and_a_truncated_cache_start_again_compiled(toy_model_dir, tmp_path):
    cache = tmp_path / "inductor"
    _kill_during_the_first_build(toy_model_dir, cache)
    log, mapped = _start(toy_model_dir, cache)
    assert "STEP compiled" in log and "torch.compile failed" not in log, log[-3000:]
    assert mapped and all(elf_problem(p) is None for p in mapped)
    libraries = [p for p in cache.rglob("*.so")]
    for lib in libraries:  # what a compile killed while linking each one leaves
        os.truncate(lib, lib.stat().st_size // 2)
    log, mapped = _start(toy_model_dir, cache)
    assert mapped and all(elf_problem(p) is None for p in mapped), "a truncated library was loaded"
    assert "STEP compiled" in log and "torch.compile failed" not in log, log[-3000:]
    assert log.count("inductor cache: removed") >= 1
