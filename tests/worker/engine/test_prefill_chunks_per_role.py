"""The per-step prefill budget: a colocated (or decode) worker prefills a long prompt in chunks
while its running streams keep getting a token every step, with outputs unchanged; a prefill
worker takes whole prompts. Defaults come from the role and a setting overrides them."""

from __future__ import annotations

import pytest
from tandem.contracts.names import Role
from tandem.testing.engine_helpers import greedy, submit, tokens_of
from tandem.worker.server.config import WorkerConfig

LONG = ("Once upon a time there was a little model that wanted to speak every language. Prefill reads the "
        "whole prompt at once; decode writes one token at a time. ") * 2


def test_running_stream_gets_a_token_every_step_while_a_long_prompt_is_chunked(make_engine, loaded_toy,
                                                                                reference):
    eng = make_engine(block_size=4, prefill_chunk_tokens=8)
    tok = loaded_toy.tokenizer
    short, long_ids = tok("Hello, world!")["input_ids"], tok(LONG)["input_ids"]
    assert len(long_ids) > 40
    first = submit(eng, "short", short, greedy(30))
    eng.step()  # the short prompt is in and decoding
    second = submit(eng, "long", long_ids, greedy(6))
    steps, batches = 0, []
    eng.on_step = lambda seconds, n: batches.append(n)
    while not second or not second[0].token_ids:
        before = len(tokens_of(first))
        eng.step()
        steps += 1
        assert len(tokens_of(first)) == before + 1, "the running stream missed a step"
    assert steps == -(-len(long_ids) // 8), "the prompt was meant to take one 8-token chunk per step"
    assert max(batches) <= 8 + 1
    while eng.has_work():
        eng.step()
    assert tokens_of(first) == reference(short, 30)
    assert tokens_of(second) == reference(long_ids, 6)


@pytest.mark.parametrize(("role", "expected"), [(Role.COLOCATED, 256), (Role.DECODE, 256), (Role.PREFILL, None)])
def test_role_defaults(role, expected):
    cfg = WorkerConfig(role=role, model="m").engine_config()
    assert cfg.prefill_chunk_tokens == expected  # None: whole prompts up to max_batched_tokens


def test_setting_overrides_the_role_default_and_bad_values_are_refused():
    assert WorkerConfig(model="m", prefill_chunk_tokens=64).engine_config().prefill_chunk_tokens == 64
    assert WorkerConfig(model="m", max_batched_tokens=128).engine_config().prefill_chunk_tokens == 128
    assert WorkerConfig.from_values({"model": "m", "prefill-chunk-tokens": 512}, "flags").prefill_chunk_tokens == 512
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        WorkerConfig(model="m", prefill_chunk_tokens=0)
    with pytest.raises(ValueError, match="compile"):
        WorkerConfig(model="m", compile="sometimes")


def test_a_decode_worker_sizes_the_chunk_beside_its_streams_and_outputs_do_not_change(make_engine, loaded_toy,
                                                                                      reference):
    eng = make_engine(block_size=4, prefill_chunk_tokens=64, prefill_stall_factor=2.0)
    tok = loaded_toy.tokenizer
    short, long_ids = tok("Hello, world!")["input_ids"], tok(LONG * 2)["input_ids"]
    first = submit(eng, "short", short, greedy(300))
    eng.step()
    for _ in range(3):
        eng.step()  # decode-only steps: the ordinary step is measured
    second = submit(eng, "long", long_ids, greedy(6))
    chunks, allowed = [], []
    eng.on_step = lambda seconds, n: chunks.append(n - 1)  # the stream's one token aside
    while not second or not second[0].token_ids:
        before = len(tokens_of(first))
        allowed.append(min(eng.chunk_sizer.budget(1), len(long_ids) - sum(chunks)))
        eng.step()
        assert len(tokens_of(first)) == before + 1, "the running stream missed a step"
    assert chunks == allowed, "each chunk is what the sizer allowed beside one decoding stream"
    assert sum(chunks) == len(long_ids) and max(chunks) <= 64
    while eng.has_work():
        eng.step()
    assert tokens_of(first) == reference(short, 300)
    assert tokens_of(second) == reference(long_ids, 6)


@pytest.mark.parametrize(("role", "expected"), [(Role.COLOCATED, None), (Role.DECODE, 2.0), (Role.PREFILL, None)])
def test_only_a_decode_worker_sizes_its_chunks_by_default(role, expected):
    assert WorkerConfig(role=role, model="m").engine_config().prefill_stall_factor == expected


def test_the_stall_factor_can_be_set_or_turned_off_and_bad_values_are_refused():
    assert WorkerConfig(role=Role.COLOCATED, model="m", prefill_stall_factor=3).engine_config().prefill_stall_factor == 3
    assert WorkerConfig(role=Role.DECODE, model="m", prefill_stall_factor=0).engine_config().prefill_stall_factor is None
    with pytest.raises(ValueError, match="prefill_stall_factor"):
        WorkerConfig(model="m", prefill_stall_factor=0.5)


def test_a_flood_beside_another_tenant_prefills_short_chunks_and_outputs_do_not_change(make_engine, loaded_toy,
                                                                                      reference):
    """--flow-chunk-tokens through the engine: the quiet tenant's prompt is prefilled in a step of its
    own, the flood's long prompt goes on in chunks of the cap while the quiet tenant is about, and every
    text is unchanged."""
    from tandem.contracts.protocol import GenerateRequest

    eng = make_engine(block_size=4, prefill_chunk_tokens=64, flow_chunk_tokens=8)
    tok = loaded_toy.tokenizer
    long_ids, short = tok(LONG * 2)["input_ids"], tok("Hello, world!")["input_ids"]

    def add(rid, ids, flow):
        outs = []
        seq = eng.make_sequence(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=greedy(4),
                                                fairness_id=flow))
        seq.sink = outs.append
        eng.add(seq)
        return outs

    flood = add("flood", long_ids, "flood")
    eng.step()  # the flood alone: a whole chunk
    quiet = add("quiet", short, "quiet")
    batches = []
    eng.on_step = lambda seconds, n: batches.append(n)
    eng.step()  # the quiet prompt whole (it was served least), alone: none of the flood's tokens beside it
    eng.step()  # the flood, served more than the quiet tenant: 8 tokens, the quiet one's decode
    assert batches == [len(short), 8 + 1]
    while eng.has_work():
        eng.step()
    assert tokens_of(flood) == reference(long_ids, 4)
    assert tokens_of(quiet) == reference(short, 4)


def test_the_flow_chunk_default_and_its_setting():
    from tandem.worker.server.config import DEFAULT_FLOW_CHUNK

    assert WorkerConfig(model="m").engine_config().flow_chunk_tokens == DEFAULT_FLOW_CHUNK
    assert WorkerConfig.from_values({"model": "m", "flow-chunk-tokens": 64}, "flags").engine_config().flow_chunk_tokens == 64
    assert WorkerConfig(model="m", flow_chunk_tokens=0).engine_config().flow_chunk_tokens is None, "0: no cap"
    with pytest.raises(ValueError, match="flow_chunk_tokens"):
        WorkerConfig(model="m", flow_chunk_tokens=-1)
