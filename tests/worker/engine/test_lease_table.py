"""The lease table on its own: a lease is found, read and taken out only with its token, only
while it lives, and only for the blocks it holds; expiry lists what nobody came for; the table
frees nothing and writes no state itself (the request table moves the sequence, the engine gives
the blocks back)."""

from __future__ import annotations

import pytest
from tandem.contracts.sampling import SamplingParams
from tandem.worker.engine.leases import LeaseTable
from tandem.worker.engine.request_state import RequestState
from tandem.worker.engine.sequence import EngineSequence


def _seq(rid: str, blocks: list[int]) -> EngineSequence:
    seq = EngineSequence(request_id=rid, prompt_ids=[1, 2, 3], params=SamplingParams(), max_total_len=64, seed=0)
    seq.block_table = list(blocks)
    return seq


def test_a_lease_is_read_and_taken_only_with_its_token():
    table = LeaseTable(lease_s=30.0)
    seq = _seq("r", [4, 5, 6])
    lease = table.add(seq, now=100.0)
    assert seq.status is RequestState.NEW and "r" in table and len(table) == 1, "no state written here"
    token = table.token("r")
    assert token == lease.token and len(token) >= 32
    assert table.may_read("r", token, [5, 6], now=100.0)
    assert not table.may_read("r", token, [5, 7], now=100.0), "a block the lease does not hold"
    assert not table.may_read("r", "wrong", [5], now=100.0)
    assert not table.may_read("r", token, [5], now=130.0), "expired"
    assert table.take("r", "wrong") is None and "r" in table
    assert table.take("r", token) is lease and "r" not in table
    assert seq.status is RequestState.NEW and seq.block_table == [4, 5, 6], "the owner frees the blocks"
    assert table.take("r", token) is None and table.token("r") is None


def test_expiry_lists_what_nobody_pulled_and_the_owner_takes_it_out():
    table = LeaseTable(lease_s=10.0)
    table.add(_seq("early", [1]), now=0.0)
    table.add(_seq("late", [2]), now=5.0)
    assert table.next_expiry() == 10.0
    assert table.expired(now=9.9) == []
    assert table.expired(now=10.0) == ["early"]
    assert table.take("early", None) is not None  # the owner itself needs no token
    assert table.next_expiry() == 15.0 and table.expired(now=20.0) == ["late"]


def test_one_lease_per_id():
    table = LeaseTable(lease_s=1.0)
    table.add(_seq("x", [1]))
    with pytest.raises(ValueError):
        table.add(_seq("x", [2]))
    with pytest.raises(ValueError):
        LeaseTable(lease_s=-1)
