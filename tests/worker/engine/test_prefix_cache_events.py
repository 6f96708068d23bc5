"""The engine's KV events (what GET /internal/kv/events streams to the router) follow its prefix
cache exactly: a snapshot taken under its lock plus every event after it equals what it caches,
through stores, evictions, preemption and leases; each call names a hash at most once and comes
while the engine's lock is held; the hashes are the shared block hash of the tokens."""

from __future__ import annotations

import torch
from tandem.contracts.prefix import block_hashes
from tandem.contracts.protocol import GenerateRequest
from tandem.testing.engine_helpers import greedy, submit

BS = 4


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 300, (n - 1,), generator=g).tolist()


class Subscriber:
    """What worker/server/kv_events.py's publisher does: snapshot and hook, both under the lock."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls = 0
        self.held: set[bytes] = set()
        assert engine.follow_kv_events(self.on_snapshot, self.on_kv_event)

    def on_snapshot(self, block_size: int, salt: bytes, hashes: list[bytes]) -> None:
        assert self.engine.lock._lock._is_owned(), "the snapshot outside the engine's lock"
        self.held = set(hashes)

    def on_kv_event(self, stored: list[bytes], removed: list[bytes]) -> None:
        assert self.engine.lock._lock._is_owned(), "an event outside the engine's lock"
        assert not set(stored) & set(removed), "a hash in both lists of one call"
        assert not set(stored) & self.held, "stored twice"
        assert set(removed) <= self.held, "removed what was never stored"
        self.held.difference_update(removed)
        self.held.update(stored)
        self.calls += 1


def test_snapshot_plus_events_equal_the_cache(make_engine):
    eng = make_engine(block_size=BS, max_waiting=64, num_blocks=28, max_num_seqs=3, max_batched_tokens=64)
    system = ids(25, 1)
    submit(eng, "before", system + ids(9, 2), greedy(6))
    for _ in range(3):
        eng.step()
    sub = Subscriber(eng)  # bound mid-traffic, as a router that connects at any time
    for i in range(8):  # more than the pool holds: preemption and eviction
        submit(eng, f"r{i}", system + ids(20 + 3 * i, 10 + i), greedy(24))
    lease = eng.make_sequence(GenerateRequest(request_id="lease", prompt_token_ids=system + ids(7, 30),
                                              sampling=greedy(3)), prefill_only=True)
    eng.add(lease)
    while eng.has_work():
        eng.step()
        with eng.lock:
            assert sub.held == set(eng.cached_block_hashes())
    eng.abort("lease", eng.lease_token("lease"))
    assert eng.allocator.evictions_total > 0 and eng.stats.preemptions_total > 0
    assert sub.calls > 0
    with eng.lock:
        assert sub.held == set(eng.cached_block_hashes())
        named = {eng.allocator.hash_of(b) for b in range(eng.allocator.num_blocks)} - {None}
        assert sub.held == named


def test_hashes_are_the_shared_block_hash_of_the_tokens(make_engine):
    eng = make_engine(block_size=BS, max_waiting=64)
    sub = Subscriber(eng)
    prompt = ids(30, 5)
    out = submit(eng, "h", prompt, greedy(9))
    while eng.has_work():
        eng.step()
    tokens = prompt + [t for o in out for t in o.token_ids]
    computed = tokens[:-1]  # the last sampled token never ran through the model
    assert sub.held == set(block_hashes(computed, BS, eng.prefix_hash_salt))


def test_events_come_one_call_per_step(make_engine):
    eng = make_engine(block_size=BS, max_waiting=64, max_batched_tokens=256)
    sub = Subscriber(eng)
    for i in range(4):
        submit(eng, f"b{i}", ids(40, 60 + i), greedy(2))
    eng.step()  # four prompts prefilled: 40 blocks named in one step
    assert sub.calls == 1 and len(sub.held) == 4 * 10
    while eng.has_work():
        eng.step()
