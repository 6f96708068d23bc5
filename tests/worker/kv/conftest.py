"""Fixtures for the KV handoff tests: layouts, and KV peers in-process and as processes on loopback."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeer, KVPeerProcess
from tandem.worker.kv.base import KVTransferConfig

# NIXL's UCX backend between processes on loopback: TCP is the transport every machine has.
os.environ.setdefault("UCX_TLS", "tcp")



@pytest.fixture
def peer_process() -> Iterator[list[KVPeerProcess]]:
    """Start KVPeerProcess objects by appending them; all are killed at the end, even on failure."""
    started: list[KVPeerProcess] = []
    yield started
    for p in started:
        p.kill()


@pytest.fixture
async def decode_peer(backend: str) -> AsyncIterator[KVPeer]:
    """An in-process decode-side peer over SMALL_LAYOUT with a 3 s transfer bound."""
    peer = KVPeer(backend, SMALL_LAYOUT, f"decode-{os.getpid()}-1",
                  KVTransferConfig(backend=backend, timeout_s=3.0), fill=False)
    await peer.start()
    yield peer
    await peer.close()

