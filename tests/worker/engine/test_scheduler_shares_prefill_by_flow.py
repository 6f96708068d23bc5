"""The prefill budget shared by flow (issue 31, flow control carried to the worker): a tenant's new
prompt does not wait behind the chunks of a flooding tenant's long prompts (the flow served the
fewest tokens lately goes first, every step), a higher priority goes first, service fades with a
half-life, and one flow alone keeps first come, first served. Without a model: the scheduler's own decisions."""

from __future__ import annotations

from tandem.contracts.sampling import SamplingParams
from tandem.worker.engine.block_allocator import BlockAllocator
from tandem.worker.engine.scheduler import FLOW_ACTIVE_S, FLOW_SERVICE_HALF_LIFE_S, Scheduler
from tandem.worker.engine.sequence import EngineSequence


def _seq(rid: str, n: int, flow: str = "", priority: int = 0) -> EngineSequence:
    return EngineSequence(rid, list(range(n)), SamplingParams(), max_total_len=4096, seed=0, flow=flow,
                          priority=priority)


def _advance(chunks, token=7):
    for c in chunks:
        c.seq.num_computed += c.num_tokens
        if c.sample:
            c.seq.output_ids.append(token)


def _planned(chunks) -> list[tuple[str, int]]:
    return [(c.seq.request_id, c.num_tokens) for c in chunks]


def _clocked(s: Scheduler, start: float = 0.0) -> list[float]:
    """The scheduler's clock made a list to move by hand: now[0] += seconds."""
    now = [start]
    s.clock = lambda: now[0]
    s.served_at = now[0]
    return now


def _scheduler(chunk: int = 16) -> Scheduler:
    return Scheduler(BlockAllocator(200), block_size=4, max_num_seqs=8, max_batched_tokens=64,
                     prefill_chunk_tokens=chunk)


def test_a_quiet_tenants_prompt_goes_before_a_floods_next_chunk():
    s = _scheduler()
    flood = [_seq(f"f{i}", 4, "flood") for i in range(2)] + [_seq("long", 100, "flood")]
    for q in flood:
        s.add(q)
    _advance(s.schedule())  # f0, f1 whole; long's first 8 tokens
    _advance(s.schedule())  # f0, f1 decode; long goes on
    quiet = _seq("q", 10, "quiet")
    s.add(quiet)
    assert _planned(s.schedule()) == [("f0", 1), ("f1", 1), ("q", 10), ("long", 6)]


def test_one_flow_keeps_first_come_first_served():
    s = _scheduler()
    long, late = _seq("long", 100), _seq("late", 10)
    s.add(long)
    _advance(s.schedule())
    s.add(late)
    assert _planned(s.schedule()) == [("long", 16)], "the prompt being prefilled goes on before a newer one"


def test_the_same_holds_without_any_fairness_id_against_a_named_flow():
    s = _scheduler()
    s.add(_seq("long", 100, "flood"))
    s.add(_seq("long2", 100, "flood"))
    _advance(s.schedule())
    s.add(_seq("anon", 10))  # no fairness id: the shared flow, a tenant of its own
    assert _planned(s.schedule())[0] == ("anon", 10)


def test_a_quiet_prompt_keeps_its_place_until_it_is_prefilled():
    """Not one chunk and then behind the flood again (as a fair share would have it): the flow served
    less lately goes first in every step until its prompt is done."""
    s = _scheduler()
    for i in range(3):
        s.add(_seq(f"f{i}", 100, "flood"))
    for _ in range(4):
        _advance(s.schedule())  # the flood was served 64 tokens before the quiet tenant came
    quiet = _seq("q", 40, "quiet")
    s.add(quiet)
    for _ in range(3):
        chunks = s.schedule()
        assert chunks[0].seq is quiet and chunks[0].num_tokens == min(16, 40 - quiet.num_computed)
        _advance(chunks)
    assert quiet.output_ids, "prefilled in three steps of the budget, none lost to the flood"


def test_a_higher_priority_goes_first_whatever_it_was_served():
    s = _scheduler()
    batch = _seq("batch", 100, "a", priority=0)
    s.add(batch)
    _advance(s.schedule())
    urgent = _seq("urgent", 40, "a", priority=5)
    s.add(urgent)
    assert _planned(s.schedule()) == [("urgent", 16)]


def test_a_flood_held_to_one_sequence_still_goes_behind():
    """What ranks a flow is the service it had lately, not how many sequences it holds: a flood the
    router's gate held to one place here has still been served the most."""
    s = _scheduler()
    for i in range(4):  # the flood's earlier requests, served and gone
        f = _seq(f"old{i}", 16, "flood")
        s.add(f)
        _advance(s.schedule())
        s.remove(f)
    s.add(_seq("long", 100, "flood"))
    _advance(s.schedule())
    s.add(_seq("q", 10, "quiet"))
    assert _planned(s.schedule()) == [("q", 10), ("long", 6)]


def test_service_fades_by_half_each_half_life_and_is_forgotten():
    s = _scheduler(chunk=64)
    now = _clocked(s, 100.0)
    a = _seq("a", 60, "a")
    s.add(a)
    _advance(s.schedule())
    assert s.served == {"a": 60}
    s.remove(a)
    now[0] += FLOW_SERVICE_HALF_LIFE_S
    s.add(_seq("b", 4, "b"))
    s.schedule()
    assert s.served == {"a": 30, "b": 4}
    now[0] += 6 * FLOW_SERVICE_HALF_LIFE_S  # a's 30 tokens fade below one: a flow long gone is dropped
    s.schedule()
    assert set(s.served) == {"b"}


def _capped_scheduler(cap: int = 4) -> Scheduler:
    return Scheduler(BlockAllocator(200), block_size=4, max_num_seqs=8, max_batched_tokens=64,
                     prefill_chunk_tokens=16, flow_chunk_tokens=cap)


def _quiet_served_and_gone(s: Scheduler) -> None:
    quiet = _seq("q0", 8, "quiet")
    s.add(quiet)
    _advance(s.schedule())
    s.remove(quiet)


def test_the_flows_served_more_take_short_chunks_while_another_is_remembered():
    """The step in flight when the quiet tenant's next prompt arrives: the flood's chunk is the
    --flow-chunk-tokens cap, although the quiet tenant has nothing here between its requests."""
    s = _capped_scheduler()
    _quiet_served_and_gone(s)
    long = _seq("long", 100, "flood")
    s.add(long)
    _advance(s.schedule())  # the flood, new, was served the least: a whole chunk
    assert long.num_computed == 16
    assert _planned(s.schedule()) == [("long", 4)], "served more than the quiet tenant: capped"


def test_the_cap_is_one_budget_for_all_the_capped_flows_sequences():
    s = _capped_scheduler(cap=6)
    _quiet_served_and_gone(s)
    for i in range(3):
        s.add(_seq(f"f{i}", 100, "flood"))
    _advance(s.schedule())
    assert sum(n for _, n in _planned(s.schedule())) == 6


def test_the_flow_served_least_takes_the_whole_chunk_beside_a_capped_flood():
    s = _capped_scheduler()
    s.add(_seq("long", 100, "flood"))
    for _ in range(3):
        _advance(s.schedule())  # the flood alone: 48 tokens served
    s.add(_seq("q", 40, "quiet"))
    chunks = s.schedule()
    assert _planned(chunks) == [("q", 16)], "the prefill budget is the quiet prompt's, the flood waits"
    _advance(chunks)
    _advance(s.schedule())
    chunks = s.schedule()
    assert _planned(chunks) == [("q", 8)], "its last piece, and none of the flood's tokens beside it"
    _advance(chunks)
    assert _planned(s.schedule()) == [("q", 1), ("long", 4)], "the quiet one decodes: the flood's capped chunk"



def test_one_flow_alone_is_never_capped_and_the_cap_ends_when_the_other_is_gone_a_while():
    s = _capped_scheduler()
    now = _clocked(s)
    long = _seq("long", 1000, "flood")
    s.add(long)
    _advance(s.schedule())
    assert _planned(s.schedule()) == [("long", 16)], "no other tenant: whole chunks"
    _quiet_served_and_gone(s)
    now[0] += FLOW_ACTIVE_S
    _advance(s.schedule())
    assert _planned(s.schedule()) == [("long", 4)], "the quiet tenant may come back: it was here just now"
    now[0] += 0.1  # gone longer than FLOW_ACTIVE_S, though its service is still remembered
    chunks = s.schedule()
    assert _planned(chunks) == [("long", 16)] and "quiet" in s.served
    _advance(chunks)


def test_a_request_long_ago_from_another_flow_does_not_cap_a_tenant_alone():
    """The bench's warm-up request (no fairness id) and then one tenant alone: served more than the
    warm-up's flow, it is still never capped once that flow has been gone FLOW_ACTIVE_S."""
    s = _capped_scheduler()
    now = _clocked(s)
    warm = _seq("warm", 2)
    s.add(warm)
    _advance(s.schedule())
    s.remove(warm)
    now[0] += FLOW_ACTIVE_S + 0.1
    for i in range(3):
        q = _seq(f"q{i}", 40, "quiet")
        s.add(q)
        assert _planned(s.schedule()) == [(f"q{i}", 16)]
        s.remove(q)


def test_a_request_of_no_tenant_is_never_capped_and_caps_nobody():
    """The router's parity probe (no fairness id) beside a tenant seen just now: its prompt is one
    whole chunk, as on the probe's other path (a split one rounds differently, and the probe's
    float32 comparison is exact); and a tenant seen beside probes alone keeps whole chunks."""
    s = _capped_scheduler()
    now = _clocked(s)
    for i in range(3):  # probes: served more than the tenant below
        p = _seq(f"probe{i}", 12, "")
        s.add(p)
        _advance(s.schedule())
        s.remove(p)
    _quiet_served_and_gone(s)
    probe = _seq("probe", 40, "")
    s.add(probe)
    assert _planned(s.schedule()) == [("probe", 16)], "no tenant: not capped beside one about"
    s.remove(probe)
    now[0] += FLOW_ACTIVE_S + 0.1  # the tenant gone; a probe just now, served less than the next tenant
    p = _seq("p", 2, "")
    s.add(p)
    _advance(s.schedule())
    s.remove(p)
    long = _seq("long", 100, "flood")
    s.add(long)
    for _ in range(3):
        _advance(s.schedule())
    assert long.num_computed == 48
    assert _planned(s.schedule()) == [("long", 16)], "probes cap no tenant"
