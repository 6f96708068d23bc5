"""A brake on the TCP backend's serving rate, for tests only: a transport moving KV below the
bandwidth floor on purpose (KVTransferReady's BandwidthBelowFloor, docs/install.md).

Set TANDEM_TEST_KV_THROTTLE_BYTES_PER_S on a prefill worker and its TCP KV port sends no faster
than that, pausing between the ranges of a read; unset (always, outside tests), nothing changes.
"""

from __future__ import annotations

import asyncio
import os
import time

ENV = "TANDEM_TEST_KV_THROTTLE_BYTES_PER_S"


def rate_from_env(env: dict[str, str] | None = None) -> float | None:
    """The throttle's bytes per second, or None (the normal case)."""
    raw = (os.environ if env is None else env).get(ENV, "")
    if not raw:
        return None
    rate = float(raw)
    if rate <= 0:
        raise ValueError(f"{ENV} must be a positive number of bytes per second, got {raw!r}")
    return rate


async def pace(sent: int, since: float, rate: float | None) -> None:
    """Sleep until `sent` bytes since `since` (monotonic) fit within `rate`."""
    if rate is not None:
        await asyncio.sleep(max(0.0, since + sent / rate - time.monotonic()))
