"""The request state machine once the router knows a prompt's tokens (fake workers, in process):
maxPromptTokens refused before any worker call, the ids sent to every worker, a decode-side
prefill counted as queued prompt tokens on its worker until its first token, and the prefix
cache hits of a prefix-aware plan counted."""

from __future__ import annotations

import pytest
from tandem.contracts.kv_events import KVEventMessage, KVEventType
from tandem.contracts.names import Role
from tandem.contracts.prefix import block_hashes
from tandem.router.errors import RouterError
from tandem.router.journey import Journey, Started, Tokens
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator
from tandem.router.policies.registry import create_policy
from tandem.router.prefix_index import PrefixIndex
from tandem.router.validation import Endpoint, Limits, parse_request
from tandem.router.workers import Target, WorkerSet
from tandem.testing.fake_workers import FakeWorkers, finish, prefilled, start, token

IDS = list(range(100, 140))  # 40 tokens, as if the router had tokenized the prompt


async def machine(fake: FakeWorkers, policy, limits: Limits | None = None,
                  index: PrefixIndex | None = None) -> Orchestrator:
    workers = WorkerSet(fake, prefix_index=index)
    workers.set_targets([Target(url) for url in fake.infos])
    await workers.poll_once()
    return Orchestrator(fake, workers, policy, RouterMetrics(), limits=limits or Limits())


def request(ids: list[int], limits: Limits | None = None):
    return parse_request({"model": "toy", "prompt": ids, "max_tokens": 4}, Endpoint.COMPLETION, limits or Limits())


async def test_known_tokens_over_the_limit_are_refused_before_any_worker_call():
    limits = Limits(max_prompt_tokens=39)
    fake = FakeWorkers()
    fake.add("p1", Role.PREFILL)
    fake.add("d1", Role.DECODE)
    orch = await machine(fake, create_policy("least-loaded"), limits)
    with pytest.raises(RouterError) as info:
        async for _ in orch.run(request(IDS, limits), Journey("r1")):
            pass
    await orch.drain()
    err = info.value.body["error"]
    assert (info.value.status, err["code"], err["param"]) == (400, "context_length_exceeded", "prompt")
    assert "40 tokens" in err["message"]
    assert fake.calls == [] and fake.aborts == []


async def test_a_decode_side_prefill_counts_as_queued_prompt_tokens_until_its_first_token():
    fake = FakeWorkers()
    fake.add("d1", Role.DECODE)
    fake.on_generate("d1", [start(40), token(7, "A"), token(8, "B"), finish()])
    orch = await machine(fake, create_policy("least-loaded"))
    seen = []
    async for ev in orch.run(request(IDS), Journey("r1")):
        (view,) = orch.workers.views()
        seen.append((type(ev).__name__, view.router_prompt_tokens, view.router_inflight))
    assert seen[:2] == [("Started", 40, 1), ("Tokens", 0, 1)]  # the prompt is done once a token came
    assert fake.made("generate")[0].request.prompt_token_ids == IDS
    (view,) = orch.workers.views()
    assert (view.router_prompt_tokens, view.router_inflight) == (0, 0)


async def test_a_prefix_aware_plan_counts_its_cache_hits_and_sends_the_ids():
    index = PrefixIndex()
    fake = FakeWorkers()
    for url, role in (("p1", Role.PREFILL), ("p2", Role.PREFILL), ("d1", Role.DECODE)):
        fake.add(url, role)
        index.start(url, KVEventMessage(KVEventType.SNAPSHOT, 0, block_size=8))
    held = [h.hex() for h in block_hashes(IDS[:32], 8)]
    index.apply("p2", KVEventMessage(KVEventType.UPDATE, 1, stored=held))
    index.apply("d1", KVEventMessage(KVEventType.UPDATE, 1, stored=held[:2]))
    fake.on_prefill("p2", prefilled("p2", IDS, 7, "A"))
    fake.on_generate("d1", [start(40), token(8, "B"), finish()])
    orch = await machine(fake, create_policy("prefix-aware"), index=index)
    events = [ev async for ev in orch.run(request(IDS), Journey("r1"))]
    assert events[:2] == [Started(40), Tokens([7], "A")]
    assert fake.made("prefill")[0].url == "p2" and fake.made("prefill")[0].request.prompt_token_ids == IDS
    sample = orch.metrics.registry.get_sample_value
    assert sample("tandem_router_prompt_tokens_total") == 40
    assert sample("tandem_router_prefix_cached_tokens_total", {"role": "prefill"}) == 32
    assert sample("tandem_router_prefix_cached_tokens_total", {"role": "decode"}) == 16
