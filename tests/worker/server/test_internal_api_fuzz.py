"""Property-based fuzzing of the workers' internal API (/internal/generate, /internal/prefill,
/internal/abort, /internal/kv/release) against a real prefill and a real decode worker (processes,
TCP KV backend): every answer is a 2xx or a 4xx in OpenAI's format (the one 5xx allowed is a 503
`kv_transfer_failed` for a well-typed kv_source the prefill worker does not hold: only the peer can
tell), a stream that starts ends with a finish, and afterwards both still serve and every KV block
is back in both pools.

Bounded: `TANDEM_FUZZ_EXAMPLES` examples (default 150), derandomized so a failure reproduces.
"""

from __future__ import annotations

import json
import uuid
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
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]



@pytest.fixture(scope="module")
def workers(toy_model_dir):
    p = WorkerProcess(toy_model_dir, "prefill", "--kv-backend", "tcp", "--num-blocks", "64", "--block-size", "8")
    d = WorkerProcess(toy_model_dir, "decode", "--kv-backend", "tcp", "--num-blocks", "64", "--block-size", "8")
    try:
        p.start(), d.start()
        yield p, d
    finally:
        p.kill(), d.kill()


IDS = st.lists(st.integers(0, 600), max_size=12) | json_values
MAX_TOKENS = st.integers(1, 3) | st.integers(max_value=0) | json_values.filter(
    lambda v: not isinstance(v, int) or isinstance(v, bool))
SAMPLING: dict[str, st.SearchStrategy] = {
    "max_tokens": MAX_TOKENS, "temperature": floats | st.sampled_from([0, 1e-300, 2]) | json_values,
    "top_p": floats | json_values, "top_k": st.integers(-3, 10) | json_values,
    "seed": st.integers(-(2**70), 2**70) | json_values, "stop": texts | st.lists(texts, max_size=3) | json_values,
    "stop_token_ids": IDS, "ignore_eos": st.booleans() | json_values,
}


@st.composite
def kv_sources(draw: st.DrawFn, prefill_url: str) -> Any:
    """Mostly well-typed handoffs (wrong sizes, blocks or peers), sometimes any JSON value."""
    if draw(st.integers(0, 4)) == 0:
        return draw(json_values)
    base = {"url": prefill_url, "engine_id": "e", "backend": "tcp", "block_ids": [0], "num_tokens": 2}
    return mutate(draw, base, {
        "url": st.sampled_from([prefill_url, "not a url", "http://127.0.0.1:9"]) | json_values,
        "backend": st.sampled_from(["tcp", "nixl", "memory"]) | json_values,
        "block_ids": st.lists(st.integers(-2, 70), max_size=4) | json_values,
        "num_tokens": st.integers(-1, 40) | json_values, "extra": json_values,
    })


@st.composite
def generate_bodies(draw: st.DrawFn, prefill_url: str) -> dict[str, Any]:
    sampling = mutate(draw, {"max_tokens": draw(st.integers(1, 3)), "temperature": 0}, SAMPLING)
    sampling.setdefault("max_tokens", 1)
    base = {"request_id": uuid.uuid4().hex, "prompt": "Hello there", "sampling": sampling}
    return mutate(draw, base, {
        "prompt": texts | json_values, "prompt_token_ids": IDS, "generated_token_ids": IDS,
        "messages": st.lists(st.fixed_dictionaries({"role": texts, "content": texts | json_values})) | json_values,
        "emitted_chars": st.integers(-2, 40) | json_values, "first_token_id": st.integers(-1, 600) | json_values,
        "request_id": texts | json_values, "kv_source": kv_sources(prefill_url),
        "sampling": st.just(sampling) | json_values,
    })


@st.composite
def calls(draw: st.DrawFn, prefill_url: str, decode_url: str) -> tuple[str, str, bytes, str | None]:
    """(worker URL, path, body, Content-Type); mostly to the role that serves the path."""
    path = draw(st.sampled_from(["/internal/generate", "/internal/prefill", "/internal/abort",
                                 "/internal/kv/release"]))
    home = prefill_url if path == "/internal/prefill" else decode_url
    url = draw(st.sampled_from([home] * 4 + [prefill_url, decode_url]))
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return url, path, draw(raw_bodies()), draw(CONTENT_TYPES)
    if kind == 1:
        return url, path, dumps(draw(json_values)), "application/json"
    if path in ("/internal/abort", "/internal/kv/release"):
        body = mutate(draw, {"request_id": uuid.uuid4().hex}, {"request_id": texts | json_values})
    else:
        body = draw(generate_bodies(prefill_url))
    return url, path, dumps(body), draw(CONTENT_TYPES) if kind == 2 else "application/json"


@st.composite
def handoffs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A prompt, and how to tamper with the KVSource and first token a real prefill returns."""
    prompt = draw(st.sampled_from(["Hello there", "The quick brown fox jumps over the lazy dog " * 3]))
    tamper = draw(st.sampled_from(["none", "blocks", "tokens", "engine", "backend", "first", "extra"]))
    return prompt, {"tamper": tamper, "value": draw(json_values | st.integers(0, 70))}


def _tampered(kv: dict[str, Any], first: int, how: dict[str, Any]) -> dict[str, Any]:
    kv, value = dict(kv), how["value"]
    ids: Any = [first]
    match how["tamper"]:
        case "blocks":
            kv["block_ids"] = value if isinstance(value, list) else [value] * len(kv["block_ids"])
        case "tokens":
            kv["num_tokens"] = value
        case "engine":
            kv["engine_id"] = str(value)
        case "backend":
            kv["backend"] = value
        case "first":
            ids = [value]
        case "extra":
            kv["extra"] = value
    return {"kv_source": kv, "generated_token_ids": ids}


def _check(answer: Answer, body: bytes) -> None:
    if answer.status == 503:
        err = answer.json()["error"]
        assert err["code"] == "kv_transfer_failed" and b"kv_source" in body, err
        return
    assert answer.status < 500, (answer.status, answer.body[:500])
    if answer.status >= 400:
        assert_openai_error(answer)
    elif answer.content_type.startswith("application/x-ndjson"):
        events = [json.loads(line) for line in answer.body.splitlines() if line.strip()]
        assert events[-1]["type"] == "finish", events[-3:]


def release(url: str, prefill_result: dict[str, Any]) -> None:
    """Free a prefill result's lease with its token, as the router does."""
    body = {"request_id": prefill_result["request_id"], "lease_token": prefill_result["kv"]["lease_token"]}
    answer = post(url, "/internal/kv/release", dumps(body))
    assert answer.status == 200, answer.body[:300]


def test_internal_api_answers_every_body_with_a_2xx_or_an_openai_4xx(workers):
    p, d = workers

    @FUZZ
    @given(calls(p.url, d.url))
    def one(case: tuple[str, str, bytes, str | None]) -> None:
        url, path, body, content_type = case
        answer = post(url, path, body, content_type)
        _check(answer, body)
        if path == "/internal/prefill" and answer.status == 200 and answer.json()["kv"]:
            release(url, answer.json())  # as the router would: free the lease

    @FUZZ
    @given(handoffs())
    def handoff(case: tuple[str, dict[str, Any]]) -> None:
        prompt, how = case
        rid = uuid.uuid4().hex
        body = {"request_id": rid, "prompt": prompt, "sampling": {"max_tokens": 3, "temperature": 0}}
        res = post(p.url, "/internal/prefill", dumps(body))
        assert res.status == 200, res.body[:300]
        done = res.json()
        if done["kv"] is None:  # the first token ended it
            return
        body |= _tampered(done["kv"], done["first_token_id"], how)
        answer = post(d.url, "/internal/generate", dumps(body))
        _check(answer, dumps(body))
        if answer.status != 200:  # as the router does: the lease nobody pulled is released
            release(p.url, done)

    one()
    handoff()
    assert p.status("/ready") == d.status("/ready") == 200
    good = {"request_id": uuid.uuid4().hex, "prompt": "Still serving", "sampling": {"max_tokens": 3, "ignore_eos": True}}
    answer = post(d.url, "/internal/generate", dumps(good))
    assert answer.status == 200 and json.loads(answer.body.splitlines()[-1])["type"] == "finish"
    wait_pools_idle([p.url, d.url])


@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        (b"[" * 200_000, "application/json", 400),
        (b'{"request_id": "x", "prompt": "a", "sampling": {"seed": ' + b"1" * 5000 + b"}}", "application/json", 400),
        (b'{"request_id": "x", "prompt": "a\\ud800b"}', "application/json", 400),
        (b'{"request_id": "x", "prompt": "a", "sampling": {"temperature": NaN}}', "application/json", 400),
        (b'{"request_id": "x", "prompt": "a"}', "application/json; charset=bogus", 415),
        (b'{"request_id": "x", "prompt": "a", "sampling": {"max_tokens": 1.5}}', "application/json", 400),
        (b'{"request_id": "x", "prompt": "a", "generated_token_ids": [true]}', "application/json", 400),
        (b'{"request_id": "x", "prompt": "a", "kv_source": {"url": "u", "engine_id": "e", "backend": "tcp", '
         b'"block_ids": [0], "num_tokens": 1, "bogus": 1}}', "application/json", 400),
    ],
    ids=["deep-brackets", "5000-digit-seed", "lone-surrogate", "nan", "unknown-charset", "float-max-tokens",
         "bool-token-id", "unknown-kv-source-field"],
)
def test_the_issue_s_adversarial_bodies_are_4xx_at_the_worker(workers, body, content_type, status):
    _, d = workers
    answer = post(d.url, "/internal/generate", body, content_type)
    assert answer.status == status, answer.body[:300]
    assert_openai_error(answer)
