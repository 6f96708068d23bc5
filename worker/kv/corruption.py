"""A deliberate fault for tests only: bytes of a KV transfer that arrive wrong, which the
puller's digests must catch (worker/kv/verify.py; the end-to-end test is
tests/worker/kv/test_a_corrupted_transfer_is_recomputed_end_to_end.py).

Set TANDEM_TEST_KV_CORRUPT_READS=N on a prefill worker and the first N reads its TCP KV port serves
each send one byte flipped (the pool itself, and the digests taken from it, stay right); unset
(always, outside tests), nothing changes.
"""

from __future__ import annotations

import os

ENV = "TANDEM_TEST_KV_CORRUPT_READS"


class Corruption:
    """How many reads are still to be sent wrong."""

    def __init__(self, env: dict[str, str] | None = None):
        raw = (os.environ if env is None else env).get(ENV, "")
        self.left = int(raw) if raw else 0
        if self.left < 0:
            raise ValueError(f"{ENV} must be a count of reads, got {raw!r}")

    def garble(self, data: memoryview) -> memoryview | bytes:
        """`data` as it is, or (while reads are left to corrupt) a copy with its middle byte flipped."""
        if self.left <= 0 or not len(data):
            return data
        self.left -= 1
        wrong = bytearray(data)
        wrong[len(wrong) // 2] ^= 0xFF
        return bytes(wrong)
