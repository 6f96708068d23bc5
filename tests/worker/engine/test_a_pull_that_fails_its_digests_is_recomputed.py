"""A pull whose blocks do not match the source's digests is never served (issue 28 item 11): the
decode engine frees those blocks unnamed (no later prompt may find them in its prefix cache) and
prefills the prompt itself, so the sequence's output equals a colocated run's; a pull that matches
is used as it is; with verification off nothing is checked."""

from __future__ import annotations

import torch
from tandem.contracts.kv_source import KVSource
from tandem.contracts.protocol import GenerateRequest
from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of
from tandem.worker.engine import kv_pull
from tandem.worker.engine.kv_pull import KVEndpoint
from tandem.worker.engine.request_state import RequestState
from tandem.worker.kv.base import TransferStats
from tandem.worker.kv.verify import Verdict, block_digests

PROMPT = [0] + list(range(60, 99))  # 40 tokens: three blocks of 16
N = 6


class Delivers:
    """A transport that writes `payload` into the destination blocks, as a pull that landed would."""

    name = "memory"

    def __init__(self, pool: torch.Tensor, payload: torch.Tensor) -> None:
        self.pool, self.payload = pool, payload

    def source_extra(self) -> dict:
        return {}

    async def pull(self, request_id, source, local_block_ids, release=True):
        self.pool[local_block_ids] = self.payload[: len(local_block_ids)]
        return TransferStats(request_id, 0, 0.0, len(local_block_ids), 1)

    def still_writing(self, request_id):
        return None

    def rank_verdicts(self, request_id):  # one rank: no other ranks' verdicts
        return []


async def _at_once(attempt, timeout_s):
    return attempt()


def _colocated(make_engine) -> list[int]:
    eng = make_engine(num_blocks=32, block_size=16, compile="off")
    outs = submit(eng, "c", PROMPT, greedy(N))
    run_to_completion(eng)
    return tokens_of(outs)


async def _pull(eng, first: int, payload: torch.Tensor, digests_of: torch.Tensor, verify: bool = True):
    """A handoff of PROMPT (its first token `first`) whose source's digests are those of
    `digests_of`'s blocks, and whose transfer delivers `payload`."""
    src = KVSource(url="http://prefill", engine_id="prefill-1", backend="memory", block_ids=[4, 5, 6],
                   num_tokens=len(PROMPT), lease_token="t", kv_compat="g1", digest_algorithm="crc32",
                   digest_heads=eng.layout.num_kv_heads,
                   block_digests=block_digests(digests_of, [0, 1, 2], "crc32"))
    endpoint = KVEndpoint(Delivers(eng.pool, payload), "http://decode", "decode-1", "g1", verify=verify)
    req = GenerateRequest(request_id="h", prompt_token_ids=PROMPT, sampling=greedy(N), kv_source=src,
                          generated_token_ids=[first])
    seq = eng.make_sequence(req)
    outs: list = []
    seq.sink = outs.append
    eng.claim("h")
    try:
        report = await kv_pull.pull(eng, endpoint, req, seq, _at_once, lambda: None)
    finally:
        eng.unclaim("h")
    return report, seq, outs


def _true_kv(make_engine) -> tuple[torch.Tensor, int]:
    """PROMPT's KV as an engine computes it (its three blocks after a prefill), and its first token."""
    eng = make_engine(num_blocks=32, block_size=16, compile="off")
    outs = submit(eng, "k", PROMPT, greedy(2))
    seq = eng.seqs["k"]
    eng.step()  # the prompt's KV, and its first token (whose KV the next step writes)
    kv = eng.pool[list(seq.block_table)].clone()
    run_to_completion(eng)
    return kv, tokens_of(outs)[0]


async def test_a_corrupted_pull_is_recomputed_and_never_served(make_engine):
    want = _colocated(make_engine)
    kv, first = _true_kv(make_engine)
    bad = kv.clone()
    bad[1].view(-1)[100] += 0.5  # one value of the middle block wrong after the digest was taken
    eng = make_engine(num_blocks=32, block_size=16, compile="off")
    report, seq, outs = await _pull(eng, first, bad, kv)
    assert report.verify is Verdict.FAILED and "1 of 3 blocks" in report.verify_detail
    assert seq.status is RequestState.WAITING and seq.num_computed == 0 and seq.block_table == []
    assert eng.allocator.num_cached == 0, "blocks that failed their digests must never be named"
    run_to_completion(eng)
    assert [first, *tokens_of(outs)] == want


async def test_a_pull_that_matches_is_used(make_engine):
    want = _colocated(make_engine)
    kv, first = _true_kv(make_engine)
    eng = make_engine(num_blocks=32, block_size=16, compile="off")
    report, seq, outs = await _pull(eng, first, kv, kv)
    assert report.verify is Verdict.VERIFIED and report.verify_seconds >= 0
    assert seq.num_computed == len(PROMPT)
    run_to_completion(eng)
    assert [first, *tokens_of(outs)] == want


async def test_verification_off_checks_nothing(make_engine):
    kv, first = _true_kv(make_engine)
    eng = make_engine(num_blocks=32, block_size=16, compile="off")
    report, seq, _ = await _pull(eng, first, kv * 0, kv, verify=False)
    assert report.verify is Verdict.OFF and seq.num_computed == len(PROMPT)
    eng.abort("h")
    run_to_completion(eng)
