"""The start-up heap moved out of the garbage collector's reach once a worker is up.

After loading and compiling, a worker holds about 600k container objects (torch, transformers,
inductor's graphs) that live as long as the process. A full collection walks all of them: 330 ms
of the engine thread for the benchmark model, a stall of every stream that lands on a random step.
`gc.freeze()` moves them into the permanent generation, so later collections walk only what
requests create.

The same moment hands the memory that loading freed back to the system: glibc keeps freed blocks
below its mmap threshold (which rises to 32 MiB as large blocks are freed) in its heap, and
loading frees many (each conversion's intermediate tensors). A tensor-parallel rank of a Qwen3-MoE
kept about a third of its weights' size again resident without this (`python -m bench tp_memory`, archived: BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def return_freed_memory() -> bool:
    """glibc's malloc_trim(0): the heap's free pages returned to the system; False where the C
    library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    return bool(trim is not None and trim(0))


def freeze_startup_heap() -> int:
    """Collect once (the start-up garbage goes, not into the permanent generation), hand the memory
    it and loading freed back to the system, then freeze what is left; returns how many objects the
    collector no longer walks."""
    gc.collect()
    return_freed_memory()
    gc.freeze()
    return gc.get_freeze_count()
