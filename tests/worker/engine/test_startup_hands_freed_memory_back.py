"""Loading frees many blocks that glibc would keep in its heap (resident) for later; the start-up
hands them back to the system (heap.return_freed_memory, called by freeze_startup_heap). Measured in
a child process: blocks below the mmap threshold are allocated, every other one is freed (so the
heap cannot simply shrink from its top), and the anonymous resident memory drops once handed back."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json
from tandem.worker.engine.heap import return_freed_memory

def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

blocks = [bytearray(64 * 1024) for _ in range(4000)]  # 250 MiB in the heap, each block touched
kept = blocks[1::2]
del blocks
before = anon_kib()
ok = return_freed_memory()
print(json.dumps({"ok": ok, "before": before, "after": anon_kib(), "kept": len(kept)}))
"""


def test_freed_heap_blocks_are_no_longer_resident():
    out = json.loads(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                                    timeout=120).stdout)
    assert out["ok"], "glibc's malloc_trim was not found or released nothing"
    freed_kib = 2000 * 64
    assert out["before"] - out["after"] > freed_kib // 2, out
