"""The official `openai` client, unchanged, against `tandem up` (disaggregated, TCP KV handoff)."""

from __future__ import annotations

import urllib.request

import openai
import pytest
from tandem.contracts.routing import RouteReason

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


LONG = "The router sends the prompt to a prefill worker and streams tokens from a decode worker."
MSG = [{"role": "user", "content": LONG}]


def test_models_lists_the_served_model(client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]


def test_chat_non_streaming_with_usage(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=12,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == model_name
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completions_non_streaming(client, model_name):
    r = client.completions.create(model=model_name, prompt=LONG, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_chat_streaming_with_include_usage(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=MSG, max_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    # the same request, not streamed, says the same thing
    full = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    again = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=10, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == full.choices[0].message.content
    assert text  # sampled text exists too


def test_completions_streaming_without_usage_chunk(client, model_name):
    chunks = list(client.completions.create(model=model_name, prompt=LONG, max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_request_id_is_returned(client, model_name):
    raw = client.chat.completions.with_raw_response.create(model=model_name, messages=MSG, max_tokens=2)
    rid = raw.headers["x-request-id"]
    assert len(rid) >= 16 and raw.parse().id.endswith(rid)


def test_seed_makes_sampling_reproducible(client, model_name):
    def run(seed):
        return client.completions.create(model=model_name, prompt=LONG, max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    a, b, c = run(1234), run(1234), run(99)
    assert a == b
    assert a != c


def test_stop_string_ends_the_text(client, model_name):
    base = client.completions.create(model=model_name, prompt=LONG, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # stop on a piece of what greedy decoding produces: the answer ends just before it
    stop = base[len(base) // 2: len(base) // 2 + 2]
    assert stop.strip(), f"need a visible stop string from {base!r}"
    r = client.completions.create(model=model_name, prompt=LONG, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]
    assert r.usage.completion_tokens < 24


def test_short_prompts_skip_prefill_long_ones_use_it(client, model_name, disagg_stack):
    def routes():
        text = _get(disagg_stack.url + "/metrics")
        out = {}
        for line in text.splitlines():
            if line.startswith("tandem_router_routes_total{"):
                out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        return out

    before = routes()
    client.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    client.completions.create(model=model_name, prompt=LONG, max_tokens=2)
    after = routes()
    for reason in (RouteReason.SHORT_PROMPT, RouteReason.DISAGGREGATED):
        assert after.get(reason, 0) == before.get(reason, 0) + 1, reason


def test_router_metrics_measure_latency(client, model_name, disagg_stack):
    list(client.completions.create(model=model_name, prompt=LONG, max_tokens=4, stream=True))
    text = _get(disagg_stack.url + "/metrics")
    for name in ("tandem_time_to_first_token_seconds_count", "tandem_inter_token_latency_seconds_count",
                 "tandem_e2e_request_latency_seconds_count"):
        line = next(ln for ln in text.splitlines() if ln.startswith(name))
        assert float(line.split()[-1]) > 0
    assert 'tandem_requests_total{status="200"}' in text
    assert "tandem_router_worker_requests_total{" in text


def test_errors_from_the_stack(client, model_name):
    # prompt longer than the model's context: the worker says so, the router passes it on
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hello world " * 2000, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"
    # the same through a stream: still a 400 before any event
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi there " * 2000}],
                                       max_tokens=4, stream=True)
    assert info.value.body["code"] == "context_length_exceeded"
    # under the context but over the router's --max-prompt-tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hello world " * 320, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded" and "allows" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-" + model_name, prompt="x", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="x", max_tokens=0)
    # nothing crashed: the next request is served
    assert client.completions.create(model=model_name, prompt=LONG, max_tokens=2).usage.completion_tokens >= 1
