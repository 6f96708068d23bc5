"""Timing defaults that hold across processes (router, workers, operator), written once, and the
invariants between them.

Each process has its own setting for these (flags, config files), defaulting to the values here;
`violations()` says, in words, which cross-process rule a set of values breaks, so a test pins the
defaults (tests/contracts/test_timing_invariants.py) and a deployment can check its own values.
Seconds throughout.
"""

from __future__ import annotations

# --- the router ------------------------------------------------------------------------------
CHUNK_TIMEOUT_S = 15.0  # silence allowed between two lines of a worker's stream (and before its headers)
PREFILL_TIMEOUT_S = 60.0  # a whole /internal/prefill call, queueing included
CONNECT_TIMEOUT_S = 3.0
BUSY_WAIT_S = 10.0  # waiting for busy decode workers once the client has tokens, in all

# --- the workers -----------------------------------------------------------------------------
HEARTBEAT_S = 5.0  # a silent generate (or KV events) stream gets a heartbeat line this often
KV_RESERVE_WAIT_S = 2.0  # a handoff waits this long for free blocks, then answers 503 + Retry-After
KV_TRANSFER_TIMEOUT_S = 10.0  # a KV pull that takes longer fails
PREFILL_QUEUE_S = 10.0  # a prefill not started after this is answered 429 + Retry-After
KV_LEASE_S = 30.0  # leased KV no decode worker pulled is freed after this (prefill, and migration)
# runtime vllm: how long a vLLM prefill server keeps KV for a decode server that has not asked for it
# yet (its NixlConnector's kv_lease_duration, vLLM's own default, which Tandem renders on both sides).
# Once the request reaches the decode server, its heartbeats keep the lease; past it unheard, the
# blocks go back to the prefill's cache and may hold another prompt's KV, which a late read would
# take without a word. The router hands the request to a decode server well within it.
VLLM_KV_LEASE_S = 30
WORKER_RETRY_AFTER_S = 1.0  # the Retry-After of a worker too full for a request (queue, KV, prefill wait):
#                             short, because the router tries another worker meanwhile


def violations(
    chunk_timeout_s: float = CHUNK_TIMEOUT_S,
    prefill_timeout_s: float = PREFILL_TIMEOUT_S,
    busy_wait_s: float = BUSY_WAIT_S,
    heartbeat_s: float = HEARTBEAT_S,
    kv_reserve_wait_s: float = KV_RESERVE_WAIT_S,
    kv_transfer_timeout_s: float = KV_TRANSFER_TIMEOUT_S,
    prefill_queue_s: float = PREFILL_QUEUE_S,
    kv_lease_s: float = KV_LEASE_S,
    vllm_kv_lease_s: float = VLLM_KV_LEASE_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> list[str]:
    """The cross-process rules these values break ([]: none), each naming its settings."""
    rules = [
        (2 * heartbeat_s <= chunk_timeout_s,
         f"heartbeat_s ({heartbeat_s}) must be at most half the router's chunk_timeout_s "
         f"({chunk_timeout_s}): a request queued on a worker would look hung after one late heartbeat"),
        (kv_reserve_wait_s + kv_transfer_timeout_s < chunk_timeout_s,
         f"kv_reserve_wait_s + kv_timeout_s ({kv_reserve_wait_s} + {kv_transfer_timeout_s}) must stay "
         f"below the router's chunk_timeout_s ({chunk_timeout_s}): a decode worker answers a handoff "
         "only after both, and the router would take the silence for a dead worker"),
        (prefill_queue_s < prefill_timeout_s,
         f"prefill_queue_s ({prefill_queue_s}) must be below the router's prefill_timeout_s "
         f"({prefill_timeout_s}): a queued prefill must be refused as busy before the router gives up on it"),
        (busy_wait_s + kv_reserve_wait_s + kv_transfer_timeout_s < kv_lease_s,
         f"busy_wait_s + kv_reserve_wait_s + kv_timeout_s ({busy_wait_s} + {kv_reserve_wait_s} + "
         f"{kv_transfer_timeout_s}) must stay below kv_lease_s ({kv_lease_s}): a handoff the router holds "
         "while decode workers are busy must still find its KV leased when it is pulled"),
        (busy_wait_s + connect_timeout_s < vllm_kv_lease_s,
         f"busy_wait_s + connect_timeout_s ({busy_wait_s} + {connect_timeout_s}) must stay below "
         f"vllm_kv_lease_s ({vllm_kv_lease_s}, a vLLM prefill server's kv_lease_duration): the router hands a "
         "prefill's KV to a vLLM decode server within that sum, and only the decode server's heartbeats "
         "keep it longer; unheard, the blocks may go to another prompt before they are read"),
    ]
    return [message for holds, message in rules if not holds]
