"""Property-based fuzzing of the router's public API against a real `tandem up` stack (disaggregated,
TCP handoff): whatever the body, the headers or the bytes, the answer is a 2xx or a 4xx in OpenAI's
format (never a 5xx, never plain text), a stream that starts ends with [DONE] and no error event,
and afterwards the stack still serves and every KV block is back in both pools.

Bounded: `TANDEM_FUZZ_EXAMPLES` examples per property (default 150), derandomized so a failure
reproduces; set TANDEM_FUZZ_EXAMPLES higher to search further.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tandem.testing.hostile_json import (
    CONTENT_TYPES,
    FUZZ,
    Answer,
    assert_openai_error,
    dumps,
    floats,
    json_values,
    mutate,
    post,
    raw_bodies,
    texts,
    wait_pools_idle,
)
from tandem.testing.schemas import PERSON

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROLES = ["system", "developer", "user", "assistant", "tool"]
# max_tokens the stack accepts stay tiny (1-3) so valid examples cost milliseconds; the rest is refused
MAX_TOKENS = st.integers(1, 3) | st.integers(max_value=0) | st.integers(min_value=5000) | json_values.filter(
    lambda v: not isinstance(v, int) or isinstance(v, bool))
CONTENT = texts | st.lists(st.fixed_dictionaries({"type": st.just("text") | texts, "text": texts | json_values}),
                           max_size=3) | json_values
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES) | texts, "content": CONTENT}),
                    max_size=3) | json_values
PROMPT = texts | st.lists(st.integers(0, 600), min_size=1, max_size=12) | st.lists(texts, max_size=2) | json_values
FIELDS: dict[str, st.SearchStrategy] = {
    "max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS,
    "temperature": floats | st.sampled_from([0, 1e-300, 1e-6, 2, 2.5]) | json_values,
    "top_p": floats | st.sampled_from([1e-300, 0.5, 1]) | json_values,
    "top_k": st.integers(-3, 10) | st.integers(min_value=2**40) | json_values,
    "seed": st.integers(-(2**70), 2**70) | json_values,
    "stop": texts | st.lists(texts | st.text(min_size=200, max_size=400), max_size=20) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}) | json_values,
    "n": st.integers(-1, 3) | json_values, "best_of": json_values, "user": texts | json_values,
    "ignore_eos": st.booleans() | json_values,
    "echo": json_values, "suffix": json_values, "tools": json_values,
    "tool_choice": json_values, "presence_penalty": floats | json_values,
    "frequency_penalty": floats | json_values, "messages": MESSAGES, "prompt": PROMPT,
    # issue 20's fields: honoured ones with valid and hostile values, and refused ones
    "repetition_penalty": floats | st.sampled_from([0, 1e-300, 1.3, 10, 11]) | json_values,
    "min_p": floats | st.sampled_from([0, 0.05, 1, 1.5]) | json_values,
    "min_tokens": st.integers(-2, 5) | json_values,
    "stop_token_ids": st.lists(st.integers(-1, 600) | st.integers(min_value=2**31), max_size=4) | json_values,
    "logit_bias": st.dictionaries(st.sampled_from(["1", "5", "600", "-1", "x", "99999999999"]) | texts,
                                  floats | st.integers(-150, 150), max_size=4) | json_values,
    "top_logprobs": st.integers(-1, 25) | json_values,
    "logprobs": st.booleans() | st.integers(-1, 25) | json_values,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"},
                                        {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}])
    | json_values,
    "structured_outputs": st.fixed_dictionaries({}, optional={
        "json": st.just(PERSON) | json_values, "regex": st.sampled_from(["[a-z]{1,3}", "[a-", "(a|b)"]) | texts,
        "choice": st.lists(texts, max_size=3) | json_values, "grammar": texts | st.just('start: "a"'),
        "json_object": st.booleans()}) | json_values,
    "guided_json": st.just(PERSON) | json_values, "guided_regex": texts | st.just("[0-9]{2}"),
    "guided_choice": st.lists(texts, max_size=3) | json_values, "guided_grammar": texts,
    "chat_template_kwargs": json_values, "add_generation_prompt": json_values,
    "continue_final_message": json_values, "parallel_tool_calls": json_values, "priority": json_values,
}


@st.composite
def requests(draw: st.DrawFn, model: str) -> tuple[str, bytes, str | None]:
    """(path, body, Content-Type): a valid request with fields replaced, or raw bytes, or any JSON."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return path, draw(raw_bodies()), draw(CONTENT_TYPES)
    if kind == 1:
        return path, dumps(draw(json_values)), "application/json"
    base: dict[str, Any] = {"model": model, "max_tokens": draw(st.integers(1, 3)), "stream": draw(st.booleans())}
    base |= {"messages": [{"role": "user", "content": "Hello there"}]} if chat else {"prompt": "Once upon"}
    body = mutate(draw, base, FIELDS)
    body.setdefault("max_tokens", 1)  # never the 256-token default: the valid examples stay fast
    content_type = draw(CONTENT_TYPES) if kind == 2 else "application/json"
    return path, dumps(body), content_type


def _check(answer: Answer) -> None:
    assert answer.status < 500, (answer.status, answer.body[:500])
    if answer.status != 200:
        assert_openai_error(answer)
        return
    if answer.content_type.startswith("text/event-stream"):
        events = [ln[6:] for ln in answer.body.decode().split("\n\n") if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", answer.body[-300:]
        assert not any('"error"' in e and json.loads(e).get("error") for e in events[:-1]), answer.body[-500:]
    else:
        assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length"), answer.body[:300]


def test_public_api_answers_every_body_with_a_2xx_or_an_openai_4xx(disagg_stack, model_name):
    @FUZZ
    @given(requests(model_name))
    def one(case: tuple[str, bytes, str | None]) -> None:
        path, body, content_type = case
        _check(post(disagg_stack.url, path, body, content_type))

    one()
    for w in disagg_stack.workers():
        assert w["pid"] and disagg_stack.info(w["url"])["ready"]
    answer = post(disagg_stack.url, "/v1/completions",
                  dumps({"model": model_name, "prompt": "Still serving after the fuzz", "max_tokens": 4}))
    assert answer.status == 200 and answer.json()["usage"]["completion_tokens"] == 4
    wait_pools_idle([w["url"] for w in disagg_stack.workers()], secret=disagg_stack.secret)


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code"),
    [
        (b"[" * 200_000, "application/json", 400, "invalid_json"),
        (b'{"model": "m", "prompt": "a", "seed": ' + b"1" * 5000 + b"}", "application/json", 400, "invalid_value"),
        (b'{"model": "m", "prompt": "a\\ud800b"}', "application/json", 400, "invalid_value"),
        (b'{"model": "m", "prompt": "a\xed\xa0\x80b"}', "application/json", 400, "invalid_json"),
        (b'{"model": "m", "prompt": "a", "temperature": NaN}', "application/json", 400, "invalid_value"),
        (b'{"model": "m", "prompt": "a", "temperature": Infinity}', "application/json", 400, "invalid_value"),
        (b'{"model": "m", "prompt": "a", "top_p": 1e999}', "application/json", 400, "invalid_value"),
        (b'{"model": "m", "prompt": "a"}', "application/json; charset=utf-16", 415, "unsupported_media_type"),
        (b'{"model": "m", "prompt": "a"}', "application/json; charset=bogus", 415, "unsupported_media_type"),
        (b'{"model": "m", "prompt": "a"}', "text/plain", 415, "unsupported_media_type"),
    ],
    ids=["deep-brackets", "5000-digit-seed", "escaped-lone-surrogate", "encoded-surrogate", "nan", "infinity",
         "1e999", "utf-16-charset", "unknown-charset", "text-plain"],
)
def test_the_issue_s_adversarial_bodies_are_4xx(disagg_stack, body, content_type, status, code):
    answer = post(disagg_stack.url, "/v1/completions", body, content_type)
    assert answer.status == status, answer.body[:300]
    assert assert_openai_error(answer)["code"] == code


def test_a_tiny_temperature_is_greedy_and_harms_no_neighbour(disagg_stack, model_name):
    """temperature 1e-300 is valid (OpenAI allows 0..2), samples greedily (same text as 0), and a
    greedy stream running beside it on the same workers is untouched (before: both got a 502)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", disagg_stack.port, timeout=120)
    conn.request("POST", "/v1/completions", dumps({
        "model": model_name, "prompt": "An innocent greedy neighbour", "max_tokens": 300, "ignore_eos": True,
        "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
    neighbour = conn.getresponse()
    assert neighbour.status == 200 and neighbour.readline().startswith(b"data: ")  # it is running
    base = {"model": model_name, "prompt": "The greedy one", "max_tokens": 8, "ignore_eos": True}
    tiny = post(disagg_stack.url, "/v1/completions", dumps(base | {"temperature": 1e-300}))
    greedy = post(disagg_stack.url, "/v1/completions", dumps(base | {"temperature": 0}))
    assert greedy.status == tiny.status == 200, (greedy.body, tiny.body)
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    rest = neighbour.read().decode()
    assert rest.rstrip().endswith("data: [DONE]") and '"error"' not in rest
    assert '"finish_reason":"length"' in rest
