"""The prefix index (pure) and the prefix-aware policy over it: a conversation's later turns go to
the workers holding its prefix (prefill and decode, and a short new tail is prefilled by decode
itself), a hot prefix spreads once its worker is loaded, the index follows snapshots, updates,
gaps, restarts and departures, and without token ids the policy is a load balancer."""

from __future__ import annotations

import random

import pytest
from tandem.contracts.kv_events import KVEventMessage, KVEventType
from tandem.contracts.names import Role
from tandem.contracts.prefix import block_hashes
from tandem.contracts.routing import RouteReason
from tandem.router.policies.base import PolicySettings, RequestInfo, Route, Snapshot, WorkerView
from tandem.router.policies.prefix_aware import PrefixAware
from tandem.router.policies.registry import create_policy
from tandem.router.prefix_index import PrefixIndex

BS = 16
SALT = b"model-a"


def W(url: str, role: Role = Role.DECODE, **kw) -> WorkerView:
    return WorkerView(url=url, role=role, kv_compat="g1", ready=True, **kw)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def req(tokens: list[int]) -> RequestInfo:
    return RequestInfo("r", len(tokens), list(tokens))


def hexes(tokens: list[int], block_size: int = BS, salt: bytes = SALT) -> list[str]:
    return [h.hex() for h in block_hashes(tokens, block_size, salt)]


def snapshot(tokens: list[int] = (), seq: int = 0, engine_id: str = "e1", **kw) -> KVEventMessage:
    kw.setdefault("block_size", BS)
    kw.setdefault("salt", SALT.hex())
    return KVEventMessage(KVEventType.SNAPSHOT, seq, engine_id=engine_id, hashes=hexes(list(tokens)), **kw)


def update(seq: int, stored: list[int] = (), removed: list[int] = ()) -> KVEventMessage:
    return KVEventMessage(KVEventType.UPDATE, seq, stored=hexes(list(stored)), removed=hexes(list(removed)))


def route_of(index: PrefixIndex, request: RequestInfo, ws: list[WorkerView], **settings) -> Route | None:
    """The prefix-aware route over a snapshot of `ws` holding what `index` says each caches of `request`
    (as WorkerSet.snapshot takes it)."""
    snap = Snapshot(ws, index.cached(request, [w.url for w in ws]))
    return create_policy("prefix-aware", PolicySettings(**settings)).route(request, snap)


# --- the index ---------------------------------------------------------------------------------

def test_cached_tokens_count_the_leading_blocks_held():
    index = PrefixIndex()
    system = ids(1, 64)
    index.start("w", snapshot(system))
    assert index.cached_tokens("w", req(system + ids(2, 40))) == 64
    assert index.cached_tokens("w", req(ids(3, 200))) == 0
    assert index.cached_tokens("w", req(system)) == 63  # the last prompt token is always computed
    assert index.cached_tokens("w", req(system[:40])) == 32
    assert index.cached_tokens("w", RequestInfo("r", 100)) == 0  # no token ids, nothing to match
    assert index.cached_tokens("unknown", req(system)) == 0


def test_a_hole_in_the_chain_ends_the_match():
    index = PrefixIndex()
    prompt = ids(1, 64)
    index.start("w", snapshot(prompt))
    index.apply("w", update(1, removed=prompt[:32]))  # evicts blocks 0 and 1 (chained hashes)
    assert index.blocks("w") == 2
    assert index.cached_tokens("w", req(prompt + [1])) == 0


def test_the_block_size_and_salt_are_the_workers():
    index = PrefixIndex()
    prompt = ids(1, 64)
    index.start("w8", KVEventMessage(KVEventType.SNAPSHOT, 0, block_size=8, salt="",
                                     hashes=hexes(prompt, 8, b"")))
    index.start("other-model", snapshot(prompt, salt=b"model-b".hex()))
    assert index.cached_tokens("w8", req(prompt + [5])) == 64
    assert index.cached_tokens("other-model", req(prompt + [5])) == 0


def test_updates_follow_one_by_one_and_a_gap_is_refused():
    index = PrefixIndex()
    a, b = ids(1, 32), ids(2, 32)
    index.start("w", snapshot(a, seq=7))
    assert index.apply("w", KVEventMessage(KVEventType.HEARTBEAT, 7))
    assert index.apply("w", update(8, stored=b, removed=a))
    assert index.cached_tokens("w", req(a + [1])) == 0 and index.cached_tokens("w", req(b + [1])) == 32
    assert not index.apply("w", update(10, stored=a))  # 9 is missing: the caller resyncs
    assert not index.apply("w", KVEventMessage(KVEventType.HEARTBEAT, 9))
    assert not index.apply("w", snapshot(a, seq=8))  # a snapshot line after an update: out of place
    assert not index.apply("gone", update(1))


def test_a_snapshot_spans_lines_of_one_seq():
    index = PrefixIndex()
    prompt = ids(1, 64)
    first, rest = hexes(prompt)[:2], hexes(prompt)[2:]
    index.start("w", KVEventMessage(KVEventType.SNAPSHOT, 3, block_size=BS, salt=SALT.hex(), hashes=first))
    assert index.apply("w", KVEventMessage(KVEventType.SNAPSHOT, 3, block_size=BS, salt=SALT.hex(), hashes=rest))
    assert index.cached_tokens("w", req(prompt + [1])) == 64


def test_a_restart_replaces_what_the_worker_held_and_a_departure_forgets_it():
    index = PrefixIndex()
    old, new = ids(1, 64), ids(2, 64)
    index.start("w", snapshot(old, seq=40, engine_id="w-epoch1"))
    index.start("w", snapshot(new, seq=0, engine_id="w-epoch2"))  # the reconnected stream's snapshot
    assert index.engine_id("w") == "w-epoch2"
    assert index.cached_tokens("w", req(old + [1])) == 0 and index.cached_tokens("w", req(new + [1])) == 64
    assert index.apply("w", update(1, stored=old))  # numbering follows the new stream
    index.forget("w")
    assert index.blocks("w") == 0 and index.cached_tokens("w", req(new + [1])) == 0


def test_a_worker_without_a_prefix_cache_holds_nothing():
    index = PrefixIndex()
    index.start("w", KVEventMessage(KVEventType.SNAPSHOT, 0, enabled=False))
    assert index.cached_tokens("w", req(ids(1, 64))) == 0
    with pytest.raises(ValueError, match="start with a snapshot"):
        index.start("w", update(1))
    with pytest.raises(ValueError, match="hex|non-hexadecimal"):
        index.start("w", KVEventMessage(KVEventType.SNAPSHOT, 0, block_size=BS, hashes=["zz"]))


# --- the policy --------------------------------------------------------------------------------

def test_a_conversations_later_turns_go_to_the_workers_holding_it():
    index = PrefixIndex()
    ws = [W("p1", Role.PREFILL), W("p2", Role.PREFILL), W("p3", Role.PREFILL), W("d1"), W("d2"), W("d3")]
    for w in ws:
        index.start(w.url, snapshot())
    convs = {c: ids(100 + c, 300) for c in range(6)}
    first = {}
    for c, prompt in convs.items():  # first turns: spread by load, as least-loaded would
        route = route_of(index, req(prompt), ws)
        first[c] = (route.prefill.url, route.decode.url)
        ws[[w.url for w in ws].index(route.prefill.url)].outstanding_prompt_tokens += 300
        ws[[w.url for w in ws].index(route.decode.url)].running += 1
    assert len({p for p, _ in first.values()}) == 3 and len({d for _, d in first.values()}) == 3
    seq = dict.fromkeys((w.url for w in ws), 0)
    for c, prompt in convs.items():  # the workers report what they stored: the prompt, and + output
        p, d = first[c]
        seq[p] += 1
        index.apply(p, update(seq[p], stored=prompt))
        seq[d] += 1
        index.apply(d, update(seq[d], stored=prompt + ids(200 + c, 40)))
    for w in ws:  # and their queues drained: only the cache tells them apart
        w.outstanding_prompt_tokens = w.running = 0
    for c, prompt in convs.items():
        turn2 = prompt + ids(200 + c, 40) + ids(300 + c, 50)
        route = route_of(index, req(turn2), ws)
        assert (route.prefill.url, route.decode.url, route.reason) == (*first[c], RouteReason.DISAGGREGATED)
        assert route.cached_prefill_tokens == 288 and route.cached_decode_tokens == 336
        # with a short-tail threshold the decode worker holding the history prefills the rest itself
        route = route_of(index, req(turn2), ws, short_prompt_threshold=64)
        assert (route.decode.url, route.prefill, route.reason) == (first[c][1], None, RouteReason.CACHED_PREFIX)


def test_a_hot_prefix_spreads_when_its_worker_is_loaded():
    index = PrefixIndex()
    system = ids(7, 512)
    ws = [W("p1", Role.PREFILL), W("p2", Role.PREFILL), W("d1"), W("d2")]
    index.start("p1", snapshot(system))
    index.start("d1", snapshot(system))
    for w in ("p2", "d2"):
        index.start(w, snapshot())
    prompt = req(system + ids(8, 100))
    route = route_of(index, prompt, ws)
    assert (route.prefill.url, route.decode.url) == ("p1", "d1")
    ws[0].outstanding_prompt_tokens = 511  # queued work there still costs less than the prefix saves
    ws[2].running = 1
    assert (route_of(index, prompt, ws).prefill.url, route_of(index, prompt, ws).decode.url) == ("p1", "d1")
    ws[0].outstanding_prompt_tokens = 513  # now it costs more: the prompt goes elsewhere
    ws[2].running = 3  # 3 x 256 tokens of load outweigh the 511 cached
    route = route_of(index, prompt, ws)
    assert (route.prefill.url, route.decode.url) == ("p2", "d2")
    assert route.cached_prefill_tokens == route.cached_decode_tokens == 0
    # a burst of hot-prefix requests, each counted where it went: both workers of each pool serve it
    ws[0].outstanding_prompt_tokens, ws[2].running = 0, 0
    where = []
    for _ in range(8):
        route = route_of(index, prompt, ws)
        next(w for w in ws if w is route.prefill).router_prompt_tokens += 612 - route.cached_prefill_tokens
        next(w for w in ws if w is route.decode).router_inflight += 1
        where.append((route.prefill.url, route.decode.url))
    assert {p for p, _ in where} == {"p1", "p2"} and {d for _, d in where} == {"d1", "d2"}
    assert [p for p, _ in where].count("p1") > [p for p, _ in where].count("p2")  # the holder takes more


def test_a_loaded_decode_worker_holding_the_history_is_not_asked_to_prefill_the_tail():
    index = PrefixIndex()
    history = ids(1, 400)
    ws = [W("p1", Role.PREFILL), W("d1", running=6), W("d2")]
    index.start("d1", snapshot(history))
    route = route_of(index, req(history + ids(2, 20)), ws, short_prompt_threshold=64)
    assert (route.decode.url, route.prefill.url, route.reason) == ("d2", "p1", RouteReason.DISAGGREGATED)


def test_colocated_workers_keep_their_conversations():
    index = PrefixIndex()
    ws = [W("c1", Role.COLOCATED), W("c2", Role.COLOCATED, running=1)]
    history = ids(1, 512)
    index.start("c1", snapshot())
    index.start("c2", snapshot(history))
    route = route_of(index, req(history + ids(2, 30)), ws)
    assert (route.decode.url, route.reason, route.cached_decode_tokens) == ("c2", RouteReason.NO_PREFILL_WORKER, 512)


def test_without_token_ids_or_an_index_it_balances_load():
    ws = [W("p1", Role.PREFILL, outstanding_prompt_tokens=900), W("p2", Role.PREFILL),
          W("d1", running=2), W("d2")]
    index = PrefixIndex()
    for w in ws:
        index.start(w.url, snapshot(ids(1, 64)))
    assert index.cached(RequestInfo("r", 500), [w.url for w in ws]) == {}, "no ids: nothing to match"
    p = PrefixAware()
    route = p.route(RequestInfo("r", 500), Snapshot(ws))
    assert (route.prefill.url, route.decode.url) == ("p2", "d2")
    assert p.retry_prefill(RequestInfo("r", 500), route, Snapshot(ws), frozenset({"p2"})).url == "p1"
    assert p.resume_decode(RequestInfo("r", 500), Snapshot(ws), frozenset({"d2"})).url == "d1"
