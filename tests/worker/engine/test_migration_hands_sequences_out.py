"""A draining engine hands its sequences out between steps: a decoding one leaves with its KV
leased (prompt and generated tokens but the last, exactly as a prefill result's blocks are), a
queued one leaves without KV; the lease's blocks are freed once pulled (released with its token)
or expired. Another engine given those blocks' contents continues the sequence token for token."""

from __future__ import annotations

from tandem.contracts.protocol import GenerateRequest
from tandem.testing.engine_helpers import (
    check_blocks_accounted,
    greedy,
    run_to_completion,
    submit,
    tokens_of,
)

PROMPT = list(range(5, 45))  # 40 tokens: two and a half blocks of 16


def _decode_until(engine, outs: list, n: int) -> None:
    """Step until `outs` holds n tokens (each step adds one per decoding sequence)."""
    for _ in range(200):
        if len(tokens_of(outs)) >= n:
            return
        engine.step()
    raise AssertionError(f"only {len(tokens_of(outs))} tokens after 200 steps")


def test_running_sequence_leaves_with_its_kv_leased_and_queued_one_without(make_engine):
    eng = make_engine(max_num_seqs=1)
    running = submit(eng, "run", PROMPT, greedy(30))
    queued = submit(eng, "queued", PROMPT[:10], greedy(5))
    _decode_until(eng, running, 6)
    assert not queued, "max_num_seqs=1: the second one waits"
    eng.start_migration()
    eng.step()
    last = running[-1]
    assert last.migrated and not last.finished and last.kv_blocks is not None
    seq = eng.leases["run"].seq
    assert seq.num_computed == len(PROMPT) + len(seq.output_ids) - 1, "KV of all but the last token"
    assert last.kv_blocks == seq.block_table[:eng.layout.blocks_for(seq.num_computed)]
    assert queued == [queued[0]] and queued[0].migrated and queued[0].kv_blocks is None
    assert not eng.seqs and not eng.has_work()
    assert eng.stats.migrated_out == {"kv": 1, "recompute": 1}
    check_blocks_accounted(eng)
    assert not eng.release_lease("run", "a wrong token"), "the lease's token is needed to free it"
    assert eng.release_lease("run", eng.lease_token("run"))
    assert eng.allocator.num_used == 0


def test_an_unpulled_migration_lease_expires(make_engine):
    eng = make_engine(lease_s=30.0)
    outs = submit(eng, "x", PROMPT, greedy(20))
    _decode_until(eng, outs, 3)
    eng.start_migration()
    eng.step()
    assert outs[-1].migrated and "x" in eng.leases
    assert eng.next_lease_expiry() is not None
    assert eng.expire_leases(now=eng.next_lease_expiry()) == ["x"]
    assert eng.allocator.num_used == 0


def test_a_sequence_added_while_draining_leaves_at_the_next_step(make_engine):
    eng = make_engine()
    eng.start_migration()
    outs = submit(eng, "late", PROMPT, greedy(8))
    eng.step()
    assert len(outs) == 1 and outs[0].migrated and outs[0].kv_blocks is None
    assert eng.stats.prefill_tokens_computed_total == 0, "handed out before any compute"


def test_the_leased_kv_continues_the_sequence_on_another_engine(make_engine, reference):
    """What a decode-to-decode pull does, without a transport: copy the leased blocks into blocks
    the destination reserved, add the sequence with its generated tokens: the rest of the output
    equals transformers' greedy generate, and the destination computes no prefill token."""
    src, dst = make_engine(), make_engine()
    outs = submit(src, "m", PROMPT, greedy(24))
    _decode_until(src, outs, 9)
    src.start_migration()
    src.step()
    assert outs[-1].migrated
    generated = tokens_of(outs)
    seq = dst.make_sequence(GenerateRequest(request_id="m", prompt_token_ids=PROMPT, sampling=greedy(24),
                                            generated_token_ids=generated))
    dst.claim("m")
    res = dst.begin_pull(seq)
    assert res is not None and not res.cached and len(res.fresh) == len(outs[-1].kv_blocks)
    for s, d in zip(outs[-1].kv_blocks, res.fresh, strict=True):
        dst.pool[d].copy_(src.pool[s])
    assert src.release_lease("m", src.lease_token("m"))
    more: list = []
    seq.sink = more.append
    dst.finish_pull(seq)
    run_to_completion(dst)
    assert generated + tokens_of(more) == reference(PROMPT, 24)
    assert dst.stats.prefill_tokens_computed_total == 0
    assert more[-1].finished
