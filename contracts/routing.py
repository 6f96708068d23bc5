"""Why the router sent a request where it did (one word each, safe as a Prometheus label value), the
policies `router.policy` names, and the routing defaults the router's settings and the CRD share."""

from __future__ import annotations

import enum


class RouteReason(enum.StrEnum):
    DISAGGREGATED = "disaggregated"  # prefill worker, then a KV handoff to a decode worker
    NO_PREFILL_WORKER = "no_prefill_worker"  # none ready: the decode worker prefills itself
    SHORT_PROMPT = "short_prompt"  # below the threshold: cheaper to prefill on decode
    NO_MATCHING_KV_COMPAT = "no_matching_kv_compat"  # no prefill/decode pair of one kv_compat
    PREFILL_FAILED = "prefill_failed"  # every prefill attempt failed: decode-side prefill
    PREFILL_SATURATED = "prefill_saturated"  # the prefill pool is busy, a decode worker has room
    CACHED_PREFIX = "cached_prefix"  # the decode worker holds all but a short tail of the prompt
    PARITY_UNVERIFIED = "parity_unverified"  # no pair the handoff parity probe has proven yet
    PARITY_MISMATCH = "parity_mismatch"  # the handoff parity probe found the pair disagreeing
    # behind a gateway (contracts/gateway.py), the decode pod's sidecar follows the picker's choice:
    GATEWAY_DECODE = "gateway_decode"  # the picker named no prefill worker: the decode worker prefills
    GATEWAY_PREFILL_UNUSABLE = "gateway_prefill_unusable"  # none it named may hand KV to this decode worker


class RoutingPolicy(enum.StrEnum):
    """The policies `router.policy` may name (the router's registry maps each to its class)."""

    LEAST_LOADED = "least-loaded"  # prefill by queued prompt tokens, decode by running sequences
    ROUND_ROBIN = "round-robin"  # each pool in turn, ignoring load
    PREFIX_AWARE = "prefix-aware"  # the prompt's tokens a worker must still compute or queue behind


class FirstToken(enum.StrEnum):
    """`router.firstToken`: when a handoff's first token (the prefill worker's) reaches the client."""

    AT_ONCE = "at-once"  # as soon as prefill returns it: the KV handoff is then a gap in the stream
    WITH_DECODE = "with-decode"  # with the decode worker's first token: the handoff is in the TTFT


# Load-aware disaggregation: the prefill pool is saturated when every prefill worker has this many
# prompt tokens queued (about two long prompts); a decode worker running fewer sequences than
# DECODE_HEADROOM_SEQUENCES may then prefill a prompt itself.
PREFILL_SATURATED_TOKENS = 2048
DECODE_HEADROOM_SEQUENCES = 16
# prefix-aware: one sequence running on a decode worker weighs as much as this many prompt tokens
PREFIX_SEQUENCE_COST_TOKENS = 256
