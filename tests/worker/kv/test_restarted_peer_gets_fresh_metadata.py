"""A restarted prefill worker (same URL, new engine_id) is re-discovered; its predecessor's KV is never served."""

from __future__ import annotations

import pytest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeer, KVPeerProcess
from tandem.worker.local.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_restarted_prefill_is_used_and_stale_sources_fail(backend: str, decode_peer: KVPeer,
                                                                 peer_process: list) -> None:
    http_port, tcp_port = free_port(), free_port()
    old = KVPeerProcess(backend, SMALL_LAYOUT, "prefill-host-100", port=http_port, tcp_port=tcp_port)
    peer_process.append(old)
    url = old.start()
    res = await decode_peer.pull("a", await old.prefill("a", 50, seed=1), seed=1)
    assert res["ok"] and res["identical"]
    stale_1 = await old.prefill("b", 50, seed=2)
    stale_2 = await old.prefill("c", 50, seed=3)
    old.kill()

    # Same URL (and, for tcp, the same data port), new start-up epoch.
    new = KVPeerProcess(backend, SMALL_LAYOUT, "prefill-host-200", port=http_port, tcp_port=tcp_port)
    peer_process.append(new)
    assert new.start() == url

    # The decode side still caches the old engine's metadata: the stale source must fail, not
    # read whatever the new process keeps at those block ids.
    res = await decode_peer.pull("b", stale_1, seed=2)
    assert not res["ok"], "a KVSource of the dead engine was served"
    # A source from the new engine: fresh metadata is fetched and used.
    src = await new.prefill("d", 50, seed=4)
    res = await decode_peer.pull("d", src, seed=4)
    assert res["ok"] and res["identical"], res
    assert decode_peer.transport.health().peers == {url: "prefill-host-200"}
    # With fresh metadata cached, the old engine_id is refused outright and says why.
    res = await decode_peer.pull("c", stale_2, seed=3)
    assert not res["ok"] and "re-run prefill" in res["error"], res
    # A stale source does not disturb the live peer (other handoffs from it may be in flight).
    assert decode_peer.transport.health().peers == {url: "prefill-host-200"}
    assert len(decode_peer.free) == SMALL_LAYOUT.num_blocks
    res = await decode_peer.pull("e", await new.prefill("e", 3000, seed=5), seed=5)
    assert res["ok"] and res["identical"], res


async def test_concurrent_pulls_from_a_restarted_peer_all_succeed(backend: str, decode_peer: KVPeer,
                                                                   peer_process: list) -> None:
    """Discovery of the successor happens once; no pull forgets the agent another one just added."""
    import asyncio

    http_port = free_port()
    old = KVPeerProcess(backend, SMALL_LAYOUT, "prefill-host-300", port=http_port)
    peer_process.append(old)
    url = old.start()
    assert (await decode_peer.pull("a", await old.prefill("a", 20, seed=1), seed=1))["ok"]
    old.kill()
    new = KVPeerProcess(backend, SMALL_LAYOUT, "prefill-host-400", port=http_port)
    peer_process.append(new)
    new.start()
    sources = [await new.prefill(f"n{i}", 100 * (i + 1), seed=i) for i in range(6)]
    results = await asyncio.gather(*(decode_peer.pull(f"n{i}", s, seed=i) for i, s in enumerate(sources)))
    assert all(r["ok"] and r["identical"] for r in results), results
    assert decode_peer.transport.health().peers == {url: "prefill-host-400"}
