"""The prefix-cache block hash, shared by the engine (what it stores), the KV handoff (what a
decode worker already holds) and the router (where a prompt's prefix lives).

A full block of `block_size` tokens is named by SHA-256 chained over every token id up to its
end, so equal hashes mean equal token prefixes (a collision is not a practical concern) and a
block's hash says nothing without its whole prefix. Partial blocks are never named.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16  # 128 bits of SHA-256: collisions stay out of practical reach
ROOT = b"tandem-prefix-v1"


def request_salt(salt: bytes, cache_salt: str | None) -> bytes:
    """The salt of one request's blocks: the cache's own (model, dtype, layout), and the request's
    `cache_salt` (GenerateRequest) when it has one, so tenants with different salts never share a
    block, and the router's prefix index names a salted prompt's blocks as the worker does."""
    if not cache_salt:
        return salt
    return salt + b"/cache_salt/" + hashlib.sha256(cache_salt.encode()).digest()[:HASH_BYTES]


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"",
                 parent: bytes | None = None) -> list[bytes]:
    """One hash per full block of token_ids, each chained over every block before it.

    `salt` separates caches that must never share blocks (another model, dtype or layout).
    `parent`: continue a chain (token_ids start right after the block whose hash it is), so a
    sequence that grows hashes only its new blocks; the salt is then already in the chain.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[bytes] = []
    if parent is None:
        parent = hashlib.sha256(ROOT + salt).digest()[:HASH_BYTES]
    pack = struct.Struct(f"<{block_size}q").pack
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + pack(*token_ids[start : start + block_size])).digest()[:HASH_BYTES]
        out.append(parent)
    return out
