"""Through a real `tandem up` stack (disaggregated, TCP KV): the router fetches the workers'
tokenizer, counts prompt tokens exactly as the workers do (plain prompts and chat messages through
the chat template), sends them the ids, routes short prompts by exact counts, and refuses a prompt
over maxPromptTokens before any worker computes (the workers' prompt token counters stay put); a
prefix-aware router process follows the real workers' KV event streams."""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest
from tandem.contracts.internal_auth import SECRET_ENV, auth_headers
from tandem.testing.local_stack import LocalStack
from tandem.testing.router_process import RouterProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["Hello, world!", "", "Café, naïve, 東京 and 🚀 are UTF-8 too.", "a </s> b <s> c",
           "line one\nline two\n\n\ttabbed", "The router sends the prompt to a prefill worker. " * 20]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And 東京?"}],
    [{"role": "user", "content": "a </s> b <|user|>"}],
]
STACK_MAX_PROMPT_TOKENS = 1500  # the disaggregated stack's --max-prompt-tokens (conftest.py)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text as {series: value} (labels kept in the series name)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}


def router_metric_at(url: str, series: str) -> float:
    return scrape(url).get(series, 0.0)


def router_metric(stack: LocalStack, series: str) -> float:
    return router_metric_at(stack.url, series)


def worker_prompt_tokens(stack: LocalStack) -> dict[str, float]:
    return {w["name"]: scrape(w["url"]).get("tandem_worker_prompt_tokens_total", 0.0) for w in stack.workers()}


def worker_count(stack: LocalStack, body: dict) -> int:
    """The prompt tokens a decode worker counts when it tokenizes `body`'s prompt or messages itself."""
    worker = stack.workers("decode")[0]["url"]
    data = json.dumps({"request_id": f"direct-{time.monotonic_ns()}", "sampling": {"max_tokens": 1}} | body)
    req = urllib.request.Request(worker + "/internal/generate", data=data.encode(), method="POST",
                                 headers={"Content-Type": "application/json"} | auth_headers(stack.secret))
    with urllib.request.urlopen(req, timeout=60) as r:
        first = json.loads(r.readline())
        r.read()
    assert first["type"] == "start", first
    return first["prompt_tokens"]


@pytest.fixture
def stack(disagg_stack: LocalStack) -> LocalStack:
    """The session's disaggregated stack, once its router has loaded the workers' tokenizer."""
    deadline = time.monotonic() + 60
    while router_metric(disagg_stack, "tandem_router_tokenizer_active") != 1:
        assert time.monotonic() < deadline, "the router never loaded the workers' tokenizer:\n" + disagg_stack.log()[-3000:]
        time.sleep(0.1)
    return disagg_stack


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_token_counts_equal_the_workers(stack, client, model_name, prompt):
    before = router_metric(stack, "tandem_router_prompt_tokens_total")
    usage = client.completions.create(model=model_name, prompt=prompt, max_tokens=1).usage
    assert usage.prompt_tokens == worker_count(stack, {"prompt": prompt})
    # the router counted these tokens itself: it tokenized the prompt and sent the workers its ids
    assert router_metric(stack, "tandem_router_prompt_tokens_total") - before == usage.prompt_tokens


@pytest.mark.parametrize("messages", CHATS)
def test_chat_token_counts_equal_the_workers_template_included(stack, client, model_name, messages):
    before = router_metric(stack, "tandem_router_prompt_tokens_total")
    usage = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens == worker_count(stack, {"messages": messages})
    assert router_metric(stack, "tandem_router_prompt_tokens_total") - before == usage.prompt_tokens


def test_the_short_prompt_bypass_counts_real_tokens(stack, client, model_name):
    """28 characters (7 tokens by the characters/4 estimate, under the stack's threshold of 8) that
    the toy tokenizer makes into 29 tokens: exactly counted, the prompt goes through prefill."""
    route = 'tandem_router_routes_total{route="%s"}'
    before = {r: router_metric(stack, route % r) for r in ("disaggregated", "short_prompt")}
    client.completions.create(model=model_name, prompt="a" * 28, max_tokens=1)
    assert router_metric(stack, route % "disaggregated") == before["disaggregated"] + 1
    assert router_metric(stack, route % "short_prompt") == before["short_prompt"]


def test_max_prompt_tokens_is_refused_before_any_worker_computes(stack, client, model_name):
    long_prompt = "hello world " * 350  # about 1,750 tokens: over the limit, within the model's 2,048
    long_chat = [{"role": "user", "content": "hi there " * 380}]
    workers_before = worker_prompt_tokens(stack)
    calls_before = {r: router_metric(stack, f'tandem_router_worker_requests_total{{role="{r}"}}')
                    for r in ("prefill", "decode")}
    with pytest.raises(openai.BadRequestError) as plain:
        client.completions.create(model=model_name, prompt=long_prompt, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=model_name, messages=long_chat, max_tokens=4, stream=True)
    assert worker_prompt_tokens(stack) == workers_before  # no worker tokenized or computed anything
    assert {r: router_metric(stack, f'tandem_router_worker_requests_total{{role="{r}"}}')
            for r in ("prefill", "decode")} == calls_before
    for err, param, body in ((plain, "prompt", {"prompt": long_prompt}), (chat, "messages", {"messages": long_chat})):
        assert (err.value.body["code"], err.value.body["param"]) == ("context_length_exceeded", param)
        exact = worker_count(stack, body)  # only now does a worker count it, to check the router's number
        assert exact > STACK_MAX_PROMPT_TOKENS
        assert f"The prompt has {exact} tokens" in err.value.body["message"]


def test_a_prefix_aware_router_follows_the_workers_kv_events(stack, model_name, monkeypatch):
    """Each worker streams what its prefix cache holds: the router's index fills from the
    snapshots and updates, without a resync, and it serves with exact token counts."""
    monkeypatch.setenv(SECRET_ENV, stack.secret)
    targets = [a for w in stack.workers() for a in ("--prefill" if w["role"] == "prefill" else "--decode", w["url"])]
    router = RouterProcess("--policy", "prefix-aware", *targets).start()
    try:
        deadline = time.monotonic() + 60
        while (router_metric_at(router.url, "tandem_router_kv_event_streams") != len(stack.workers())
               or router_metric_at(router.url, "tandem_router_tokenizer_active") != 1):
            assert time.monotonic() < deadline, router.log()[-3000:]
            time.sleep(0.1)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "The router sends the prompt to a prefill worker. " * 5}]
        usage = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2).usage
        assert usage.prompt_tokens == worker_count(stack, {"messages": messages})
        assert router_metric_at(router.url, "tandem_router_prompt_tokens_total") == usage.prompt_tokens
        assert router_metric_at(router.url, "tandem_router_kv_event_resyncs_total") == 0
        assert router_metric_at(router.url, "tandem_router_prefix_index_blocks") > 0
    finally:
        router.stop()
