"""Where a handoff's KV lies: the KVSource a prefill result (or a MIGRATE line) carries to the decode
worker that pulls it, one KVRank per extra tensor-parallel rank of the source."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Digests a KVSource may carry, one per block and KV head (tandem.worker.kv.verify computes them), by
# the bits of their values: crc32 (zlib's, over the head's bytes of a block) for a pool in host
# memory, wsum64 (a position-weighted sum of those 32-bit words, mod 2**64) for one on an accelerator.
DIGEST_ALGORITHMS = {"crc32": 32, "wsum64": 64}


@dataclass
class KVRank:
    """Where one more rank of a tensor-parallel prefill (or migrating decode) worker serves its
    share of the KV heads: its own KV endpoint, read directly by the decode ranks that need it."""

    url: str  # base URL of the rank's HTTP API (/internal/kv/metadata)
    engine_id: str  # the rank's KV agent ("<engine_id of rank 0>-r<rank>")
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific (e.g. tcp host/port)


@dataclass
class KVSource:
    """Where a decode worker finds the KV a prefill worker computed (returned by /internal/prefill)."""

    url: str  # base URL of the prefill worker's HTTP API (its rank 0)
    engine_id: str  # "<pod or host>-<epoch>": a restarted worker gets a new one
    backend: str  # "nixl" | "tcp" | "memory"
    block_ids: list[int]  # the prefill worker's blocks, in sequence order
    num_tokens: int  # tokens whose KV the blocks hold (the prompt)
    # Unguessable, one per lease: a KV read, a release or an abort of the lease must quote it.
    # Empty matches nothing. Pass it only to the decode worker chosen for this request.
    lease_token: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific (e.g. tcp host/port)
    # A tensor-parallel source: ranks 1.. (rank 0 is url/engine_id/extra above), each holding the
    # KV heads tandem.contracts.kv_layout.kv_heads_of_rank gives it; one lease (rank 0's, above)
    # covers every rank's blocks. Empty: one rank.
    ranks: list[KVRank] = field(default_factory=list)
    # The tandem.dev/kv-compat of the worker that leased the KV (a prefill worker, or a draining
    # decode worker). A worker of another kv_compat refuses it (400 kv_compat_mismatch): the
    # same tokens through other weights are other KV, and must never reach its cache.
    kv_compat: str = ""
    # One digest per block of block_ids and KV head of the model (digest_heads of them), block-major:
    # block i's head h at [i * digest_heads + h], of the bytes that head's part of the block holds
    # at the source (whichever rank holds it), taken once computed. Per head, so that a puller whose
    # ranks hold other shares of the heads checks each rank's own. The puller recomputes them over
    # the blocks it wrote and never serves KV that differs. Empty (digest_algorithm ""): not checked.
    digest_algorithm: str = ""  # a key of DIGEST_ALGORITHMS
    digest_heads: int = 0
    block_digests: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ranks = [r if isinstance(r, KVRank) else KVRank(**r) for r in self.ranks]
        self._check_digests()

    def _check_digests(self) -> None:
        if not self.digest_algorithm and not self.block_digests:
            return
        bits = DIGEST_ALGORITHMS.get(self.digest_algorithm)
        if bits is None:
            raise ValueError(f"kv_source.digest_algorithm {self.digest_algorithm!r} is not a known digest "
                             f"algorithm ({', '.join(DIGEST_ALGORITHMS)})")
        if type(self.digest_heads) is not int or self.digest_heads < 1:
            raise ValueError("kv_source.digest_heads must be the model's KV heads (>= 1) when it carries digests")
        if len(self.block_digests) != len(self.block_ids) * self.digest_heads:
            raise ValueError(f"kv_source needs one digest per block and KV head: {len(self.block_digests)} "
                             f"digests for {len(self.block_ids)} blocks of {self.digest_heads} heads")
        if any(type(v) is not int or not 0 <= v < 1 << bits for v in self.block_digests):
            raise ValueError(f"kv_source.block_digests must be unsigned {bits}-bit integers "
                             f"({self.digest_algorithm})")

    @property
    def has_digests(self) -> bool:
        return bool(self.block_digests)

    @property
    def tensor_parallel(self) -> int:
        return 1 + len(self.ranks)

    def without_leading_blocks(self, k: int, block_size: int) -> KVSource:
        """The source of all but its first k blocks (a puller whose prefix cache holds them), with
        their digests."""
        if k == 0:
            return self
        return dataclasses.replace(self, block_ids=self.block_ids[k:], num_tokens=self.num_tokens - k * block_size,
                                   block_digests=self.block_digests[k * self.digest_heads:])

    def rank(self, i: int) -> KVRank:
        """Rank i's endpoint (rank 0 is the source's own)."""
        return KVRank(self.url, self.engine_id, self.extra) if i == 0 else self.ranks[i - 1]
