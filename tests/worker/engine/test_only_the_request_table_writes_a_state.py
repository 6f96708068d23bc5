"""A request's state has one writer (issue 30, item 2): the request table (request_table.py), along the
moves request_state.TRANSITIONS allows. Nothing else in the source writes a sequence's state, a
sequence's `status` cannot be assigned, a move the map does not list is refused, every live state can
still end, and the engine's own moves through a varied load (aborts inside a step and a pull,
preemption, leases, migration, a withdrawal) are the ones the map lists."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
from tandem.contracts.protocol import FinishReason, GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.testing.engine_helpers import greedy
from tandem.worker.engine.request_state import TRANSITIONS, RequestState
from tandem.worker.engine.request_table import IllegalTransition, RequestTable
from tandem.worker.engine.sequence import EngineSequence

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ("worker", "router", "operator", "contracts", "planning", "testing", "cli", "bench")
THE_WRITER = ROOT / "worker" / "engine" / "request_table.py"
S = RequestState


def _writes_a_state(tree: ast.AST) -> list[int]:
    """Lines that assign, delete or setattr a sequence's `_status` (or setattr its `status`)."""
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr == "_status":
                    lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) in ("setattr", "__setattr__")
                and any(isinstance(a, ast.Constant) and a.value in ("_status", "status") for a in node.args)):
            lines.append(node.lineno)
    return lines


def test_no_module_but_the_request_table_writes_a_state():
    writers = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path != THE_WRITER and (lines := _writes_a_state(ast.parse(path.read_text(), str(path)))):
                writers[str(path.relative_to(ROOT))] = lines
    assert not writers, f"a request's state written outside request_table.py: {writers}"
    assert _writes_a_state(ast.parse(THE_WRITER.read_text())), "the checker no longer sees the one writer"
    assert _writes_a_state(ast.parse("seq._status = x\nsetattr(seq, 'status', x)\n")) == [1, 2]


def _seq(rid: str = "r") -> EngineSequence:
    return EngineSequence(request_id=rid, prompt_ids=[1, 2, 3], params=SamplingParams(), max_total_len=64, seed=0)


def test_a_status_cannot_be_assigned():
    seq = _seq()
    with pytest.raises(AttributeError):
        seq.status = S.RUNNING  # type: ignore[misc]
    assert seq.status is S.NEW


def _reach(start: RequestState) -> set[RequestState]:
    seen, todo = set(), [start]
    while todo:
        for nxt in TRANSITIONS.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_map_ends_every_live_state_and_final_states_stay_final():
    for state in S:
        if state.is_finished:
            assert state not in TRANSITIONS, f"{state} is final: nothing moves on from it"
        elif state is not S.CLAIMED:  # a claim is an id without a sequence: it has no moves
            assert any(s.is_finished for s in _reach(state)), f"a {state} request could never end"
    for reason in FinishReason:
        assert S.finished(reason).finish_reason is reason


@pytest.mark.parametrize("frm", [s for s in S if s in TRANSITIONS])
def test_every_move_the_map_does_not_list_is_refused(frm):
    for to in S:
        if to.holds_lease:
            continue  # a lease is taken by RequestTable.lease: below
        table, seq = RequestTable(), _seq()
        seq._status = frm  # test setup only: the state the move starts from
        if to in TRANSITIONS[frm]:
            table.move(seq, to)
            assert seq.status is to and (seq.request_id in table.seqs) == (to in (S.PULLING, S.WAITING, S.RUNNING,
                                                                                    S.ABORTING))
        else:
            with pytest.raises(IllegalTransition):
                table.move(seq, to)
            assert seq.status is frm, "a refused move changes nothing"


def test_a_lease_is_taken_and_ended_through_the_table():
    table, seq = RequestTable(lease_s=30.0), _seq()
    with pytest.raises(IllegalTransition):
        table.move(seq, S.LEASED)  # NEW cannot lease; and no move reaches a leased state without a lease
    with pytest.raises(IllegalTransition):
        table.lease(seq, S.LEASED)  # NEW cannot lease through the table either
    assert "r" not in table.leases, "a refused lease leaves none behind"
    table.move(seq, S.WAITING)
    table.move(seq, S.RUNNING)
    with pytest.raises(IllegalTransition):
        table.move(seq, S.LEASED)
    lease = table.lease(seq, S.LEASED)
    assert seq.status is S.LEASED and "r" not in table.seqs and table.state_of("r") is S.LEASED
    assert table.end_lease("r", "wrong") is None and seq.status is S.LEASED
    assert table.end_lease("r", lease.token) is lease and seq.status is S.FINISHED_HANDED_OFF
    assert table.state_of("r") is None and not table


def _record_moves(monkeypatch) -> dict[str, list[str]]:
    moves: dict[str, list[str]] = {}
    move = RequestTable.move

    def recording(self, seq, to):
        move(self, seq, to)
        moves.setdefault(seq.request_id, []).append(str(to))

    monkeypatch.setattr(RequestTable, "move", recording)
    return moves


def test_the_engine_moves_requests_only_along_the_map(make_engine, monkeypatch):
    moves = _record_moves(monkeypatch)
    eng = make_engine(num_blocks=10, block_size=4, max_num_seqs=3, max_batched_tokens=64)
    seqs = {rid: eng.make_sequence(GenerateRequest(request_id=rid, prompt_token_ids=list(range(5 + 20 * i, 15 + 20 * i)),
                                                   sampling=greedy(12)))
            for i, rid in enumerate(("a", "b", "c", "w"))}
    for rid in "abc":
        eng.add(seqs[rid])
    eng.step()
    forward = eng.runner.forward

    def forward_and_abort(items):
        eng.abort("b")  # inside the step: ABORTING, ended when the step is
        return forward(items)

    eng.runner.forward = forward_and_abort
    eng.step()
    eng.runner.forward = forward
    eng.add(seqs["w"])
    assert eng.withdraw("w"), "not started yet: taken back"
    while eng.has_work():  # 10 blocks for two streams that grow to 6 each: preemption by recompute
        eng.step()
    assert moves["b"] == ["waiting", "running", "aborting", "finished_aborted"]
    assert moves["w"] == ["waiting", "finished_withdrawn"]
    assert moves["a"][:2] == ["waiting", "running"] and moves["a"][-1] == "finished_length"
    assert eng.stats.preemptions_total > 0 and "waiting" in moves["c"][2:], "a preempted stream goes back to WAITING"
    for rid, path in moves.items():
        states = [S.NEW, *map(S, path)]
        assert all(b in TRANSITIONS[a] for a, b in itertools.pairwise(states)), (rid, path)
        assert states[-1].is_finished, (rid, path)


def test_a_prefill_lease_and_a_migration_end_in_their_own_states(make_engine, monkeypatch):
    moves = _record_moves(monkeypatch)
    pre = make_engine()
    seq = pre.make_sequence(GenerateRequest(request_id="p", prompt_token_ids=list(range(5, 25)), sampling=greedy(4)),
                            prefill_only=True)
    pre.add(seq)
    pre.step()
    assert pre.release_lease("p", pre.lease_token("p"))
    assert moves["p"] == ["waiting", "running", "leased", "finished_handed_off"]
    dec = make_engine()
    for rid in ("m", "q"):
        dec.add(dec.make_sequence(GenerateRequest(request_id=rid, prompt_token_ids=list(range(5, 25)),
                                                  sampling=greedy(8))))
    dec.step()  # both prefilled, each with its first token
    dec.start_migration()
    dec.step()
    dec.expire_leases(now=float("inf"))
    assert moves["m"] == ["waiting", "running", "migrating", "finished_migrated"]
