"""Issue 20's rows through the official `openai` client and the router, colocated and
disaggregated (TCP handoff): logprobs (chat and completions, streamed and not, the first token's
carried across the handoff), structured output (response_format, vLLM's structured_outputs and
guided_json) that parses and validates, stop_token_ids, penalties and logit_bias, min_tokens,
default max_tokens as the rest of the context; what is not built yet is a 400 naming the field."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from tandem.testing.schemas import PERSON, validate_person

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LONG = "The router sends the prompt to a prefill worker and streams tokens from a decode worker."
MSG = [{"role": "user", "content": LONG}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(params=["disaggregated", "colocated"])
def api(request, client, colocated_client):
    return client if request.param == "disaggregated" else colocated_client


def test_chat_logprobs_streamed_and_not_agree(api, model_name):
    full = api.chat.completions.create(model=model_name, messages=MSG, max_tokens=6, logprobs=True,
                                       top_logprobs=3, **GREEDY)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == full.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode())
        assert c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)  # greedy: the chosen is the likeliest
    chunks = list(api.chat.completions.create(model=model_name, messages=MSG, max_tokens=6, logprobs=True,
                                              top_logprobs=3, stream=True, **GREEDY))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
    # the first token (the prefill worker's, on the disaggregated stack) has its logprobs too
    first = next(ch for ch in chunks if ch.choices and ch.choices[0].logprobs)
    assert first.choices[0].logprobs.content[0].token == content[0].token
    assert len(streamed) == 6


def test_completion_logprobs(api, model_name):
    r = api.completions.create(model=model_name, prompt=LONG, max_tokens=5, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) == 2 for t in lp.top_logprobs)
    chunks = list(api.completions.create(model=model_name, prompt=LONG, max_tokens=5, logprobs=2, stream=True,
                                         **GREEDY))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens


@pytest.mark.parametrize("how", ["response_format", "structured_outputs", "guided_json"])
def test_schema_constrained_answer_parses_and_validates(api, model_name, how):
    kw: dict = {}
    if how == "response_format":
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    else:
        kw["extra_body"] = {"structured_outputs": {"json": PERSON}} if how == "structured_outputs" \
            else {"guided_json": PERSON}
    for seed in (1, 2):
        r = api.chat.completions.create(model=model_name, messages=MSG, max_tokens=150, temperature=1.0,
                                        seed=seed, **kw)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        validate_person(json.loads(r.choices[0].message.content))
    text = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model=model_name, messages=MSG, max_tokens=150, temperature=1.0, seed=1, stream=True, **kw) if c.choices)
    validate_person(json.loads(text))


def test_a_bad_schema_is_a_400_before_any_worker(api, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=model_name, messages=MSG, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert info.value.body["param"] == "response_format"


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_logit_bias_stop_token_ids_and_min_tokens(api, model_name, disagg_stack, colocated_stack):
    """A +100 bias makes greedy decoding pick token X every time; stop_token_ids [X] then ends the
    output at the first X; min_tokens keeps X out of the first tokens."""
    url = (disagg_stack if api.base_url.port == disagg_stack.port else colocated_stack).url
    x = _post(url, "/tokenize", {"prompt": " shells", "add_special_tokens": False})["tokens"][0]
    biased = {"ignore_eos": True, "logit_bias": {str(x): 100}}
    r = api.completions.create(model=model_name, prompt=LONG, max_tokens=5, temperature=0, extra_body=biased)
    assert r.choices[0].text == _post(url, "/detokenize", {"tokens": [x] * 5})["prompt"]
    r = api.completions.create(model=model_name, prompt=LONG, max_tokens=5, temperature=0,
                               extra_body=biased | {"stop_token_ids": [x]})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
    r = api.completions.create(model=model_name, prompt=LONG, max_tokens=8, temperature=0,
                               extra_body=biased | {"stop_token_ids": [x], "min_tokens": 3})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 4)


def test_penalties_change_a_greedy_answer(api, model_name):
    def text(**kw):
        return api.completions.create(model=model_name, prompt="She sells sea shells", max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True, **kw}).choices[0].text

    plain = text()
    # min_p 1 keeps only the likeliest token: a temperature-1 draw is then greedy
    sampled = api.completions.create(model=model_name, prompt="She sells sea shells", max_tokens=24, temperature=1.0,
                                     seed=9, extra_body={"ignore_eos": True, "min_p": 1.0}).choices[0].text
    assert sampled == plain
    assert text(repetition_penalty=1.8) != plain
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=2.0) != plain


def test_default_max_tokens_is_the_rest_of_the_context(colocated_client, model_name, colocated_stack):
    """No max_tokens: the output may run to the end of the context (2048 tokens here)."""
    prompt = _post(colocated_stack.url, "/tokenize", {"prompt": "hello world " * 1200})["tokens"][:2040]
    r = colocated_client.completions.create(model=model_name, prompt=prompt, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 2048 - 2040)


@pytest.mark.parametrize(("field", "value"), [("best_of", 2), ("suffix", "x"), ("use_beam_search", True),
                                             ("prompt_logprobs", 1)])
def test_what_is_not_built_is_a_400_naming_it(client, model_name, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="x", max_tokens=2, extra_body={field: value})
    assert info.value.body["param"] == field


def test_tokenize_and_detokenize_round_trip(client, model_name, disagg_stack):
    t = _post(disagg_stack.url, "/tokenize", {"model": model_name, "prompt": LONG})
    assert t["count"] == len(t["tokens"]) > 10 and t["max_model_len"] == 2048
    assert _post(disagg_stack.url, "/detokenize", {"tokens": t["tokens"]})["prompt"] == LONG
    chat = _post(disagg_stack.url, "/tokenize", {"messages": MSG})
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens


def test_vllm_named_metrics_carry_the_model_name(api, model_name, disagg_stack, colocated_stack):
    url = (disagg_stack if api.base_url.port == disagg_stack.port else colocated_stack).url
    list(api.completions.create(model=model_name, prompt=LONG, max_tokens=4, stream=True, **GREEDY))
    api.completions.create(model=model_name, prompt=LONG, max_tokens=3, **GREEDY)
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    label = f'model_name="{model_name}"'

    def value(prefix: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(prefix) and label in ln)
        return float(line.rsplit(" ", 1)[1])

    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert value(name) > 0, name
    assert value('vllm:request_success_total{finished_reason="length"') >= 2
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(gauge) >= 0


def test_n_choices_streamed_and_not(api, model_name):
    r = api.chat.completions.create(model=model_name, messages=MSG, max_tokens=5, n=3, temperature=1.0, seed=4,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens > 10
    assert len({c.message.content for c in r.choices}) > 1  # seeds seed, seed + 1, seed + 2
    again = api.chat.completions.create(model=model_name, messages=MSG, max_tokens=5, n=3, temperature=1.0, seed=4,
                                        extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    chunks = list(api.chat.completions.create(model=model_name, messages=MSG, max_tokens=5, n=3, temperature=1.0,
                                              seed=4, stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    texts = {i: "" for i in range(3)}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]
    assert chunks[-1].usage.completion_tokens == 15
    greedy = api.completions.create(model=model_name, prompt=LONG, max_tokens=4, n=2, **GREEDY)
    assert greedy.choices[0].text == greedy.choices[1].text  # greedy choices agree


def test_echo_and_the_chat_template_options(api, model_name):
    r = api.completions.create(model=model_name, prompt=LONG, max_tokens=3, extra_body={"echo": True, **GREEDY["extra_body"]},
                               temperature=0)
    plain = api.completions.create(model=model_name, prompt=LONG, max_tokens=3, **GREEDY)
    assert r.choices[0].text == LONG + plain.choices[0].text
    opened = [{"role": "user", "content": "Write."}, {"role": "assistant", "content": "Once upon"}]
    cont = api.chat.completions.create(model=model_name, messages=opened, max_tokens=3, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "echo": True, "ignore_eos": True})
    closed = api.chat.completions.create(model=model_name, messages=opened, max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert cont.choices[0].message.content.startswith("Once upon")
    assert cont.usage.prompt_tokens < closed.usage.prompt_tokens  # no closing newline, no generation prompt
    kw = api.chat.completions.create(model=model_name, messages=MSG, max_tokens=2, temperature=0,
                                     extra_body={"chat_template_kwargs": {"style": "x"}, "ignore_eos": True})
    assert kw.usage.completion_tokens == 2


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_required_or_named_returns_tool_calls(api, model_name, choice):
    kw = dict(model=model_name, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=80,
              temperature=1.0, seed=3, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False)
    r = api.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    streamed = [ch.choices[0].delta for ch in api.chat.completions.create(stream=True, **kw) if ch.choices]
    calls = [tc for d in streamed for tc in (d.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)  # same seed, same call
    # the call and its result go back into the next turn
    follow = api.chat.completions.create(model=model_name, max_tokens=3, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "rain"}], temperature=0)
    assert follow.choices[0].finish_reason in ("length", "stop")


def test_n_choices_share_the_prompt_s_kv(colocated_client, model_name, colocated_stack):
    """The choices after the first find the prompt in the worker's prefix cache: the worker computes
    its full blocks once, not n times."""
    def computed() -> float:
        with urllib.request.urlopen(colocated_stack.workers()[0]["url"] + "/metrics", timeout=10) as r:
            line = next(ln for ln in r.read().decode().splitlines()
                        if ln.startswith("tandem_worker_prefill_tokens_computed_total"))
        return float(line.split()[-1])

    prompt = "Once upon a time there was a little model that wanted to speak every language. " * 6
    before = computed()
    r = colocated_client.completions.create(model=model_name, prompt=prompt, max_tokens=2, n=4, temperature=1.0,
                                            seed=1, extra_body={"ignore_eos": True})
    spent = computed() - before
    assert len(r.choices) == 4 and r.usage.prompt_tokens > 100
    assert spent < 2 * r.usage.prompt_tokens, (spent, r.usage.prompt_tokens)  # 4 x without sharing
