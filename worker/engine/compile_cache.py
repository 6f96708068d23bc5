"""Keeps inductor's on-disk cache from poisoning every later start after a killed compile.

Inductor builds each kernel library straight at its final path and, on the next start, takes any
file at that path as built (`codecache._worker_compile_cpp`: `if not os.path.exists(target)`).
A compile killed mid-link (a pod deleted, Ctrl-C on `tandem up`) leaves a truncated `.so` or `.o`
there: later starts either fail to load it ("file too short": the decode step then ran eagerly,
silently slower) or map it and fault on a page past its end. Before compiling, the worker sweeps
the cache and removes every object file that is not a whole ELF file, under the same per-kernel
lock inductor builds under, so a build in progress in another process is never judged half-way.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger("tandem.worker.engine")

_ELF_MAGIC = b"\x7fELF"
_ELF64, _LITTLE = 2, 1
_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")  # Elf64_Ehdr
_PROGRAM = struct.Struct("<IIQQQQQQ")  # Elf64_Phdr
SUFFIXES = (".so", ".o")


@dataclass
class CompileRecord:
    """What this process's compiles came to (one engine a worker process; exported as metrics)."""

    failures: int = 0  # compiles that failed and left the decode step eager (compile: auto)
    last_failure: str | None = None
    objects_removed: int = 0  # broken object files the sweeps took out of the cache


RECORD = CompileRecord()


def inductor_cache_dir() -> Path:
    """Where inductor caches (TORCHINDUCTOR_CACHE_DIR, or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def elf_problem(path: Path) -> str | None:
    """Why `path` is not a whole ELF file (64-bit little-endian, as inductor builds here), or None."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size or not head.startswith(_ELF_MAGIC):
                return "no ELF header"
            ident, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _ = _HEADER.unpack(head)
            if ident[4] != _ELF64 or ident[5] != _LITTLE:
                return None  # not a kind inductor builds here: not ours to judge
            end = max(shoff + shnum * shentsize, phoff + phnum * phentsize)
            f.seek(phoff)
            table = f.read(phnum * phentsize)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if phentsize and len(table) == phnum * phentsize:
        for i in range(phnum):
            _, _, offset, _, _, filesz, _, _ = _PROGRAM.unpack_from(table, i * phentsize)
            end = max(end, offset + filesz)
    return f"{size} bytes where its headers need {end}" if size < end else None


def _lock_of(root: Path, path: Path) -> Path:
    """Inductor's lock for the kernel `path` belongs to (codecache.get_lock_dir: <key>.lock)."""
    return root / "locks" / f"{path.name.split('.', 1)[0]}.lock"


def sweep(root: Path | None = None) -> list[Path]:
    """Remove every object file under the cache that is not a whole ELF file; the removed paths.
    A file whose kernel lock another process holds is being built now: left alone."""
    root = inductor_cache_dir() if root is None else root
    if not root.is_dir():
        return []
    removed = []
    for path in (p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
        if elf_problem(path) is None:
            continue
        lock_path = _lock_of(root, path)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(str(lock_path), timeout=0):
                why = elf_problem(path)  # again, under the lock: a build may have just finished
                if why is not None and path.exists():
                    os.unlink(path)
                    removed.append(path)
                    RECORD.objects_removed += 1
                    log.warning("inductor cache: removed %s (%s), left by a compile that did not finish; "
                                "it is built again", path, why)
        except Timeout:
            continue
    return removed
