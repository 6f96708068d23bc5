"""Workers killed (SIGKILL) under a live stack: the client gets its full answer or a clean error fast.

One stack of a prefill and two decode workers for the first two tests (a stack costs ~30 s of CPU
here), and one of a prefill and a decode worker for the last, which must leave a worker alive for
`tandem up` to keep its router; each test kills what it needs and does not rely on the others
having run.
"""

from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from tandem.testing.local_stack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "Continuous batching lets sequences join and leave the running batch at every step."
MAX_TOKENS = 1200


@pytest.fixture(scope="module")
def stack(toy_model_dir):
    with LocalStack(toy_model_dir, "disaggregated", ["--kv-backend", "tcp", "--decode", "2"]) as s:
        yield s


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return _client(stack)


def _alive(stack: LocalStack, role: str) -> list[dict]:
    out = []
    for w in stack.workers(role):
        try:
            out.append(w | {"info": stack.info(w["url"], timeout_s=2)})
        except OSError:
            pass
    return out


def _serving(stack: LocalStack) -> dict:
    """The decode worker running our (only) sequence."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = [w for w in _alive(stack, "decode") if w["info"]["running"]]
        if running:
            return running[0]
        time.sleep(0.02)
    raise AssertionError("no decode worker is running the request")


def _resumes(stack: LocalStack) -> float:
    """The router's count of requests resumed on another decode worker."""
    with urllib.request.urlopen(stack.url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tandem_router_decode_resumes_total "):
                return float(line.split()[1])
    raise AssertionError("no tandem_router_decode_resumes_total in the router's metrics")


def _stream(client, model_name):
    return client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )


def test_decode_worker_killed_mid_stream_resumes_on_another(stack, client, model_name):
    assert len(_alive(stack, "decode")) == 2
    reference = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
    resumes_before = _resumes(stack)
    texts, usage, gaps = [], None, []
    killed_at = None
    last = time.monotonic()
    for i, chunk in enumerate(_stream(client, model_name)):
        now = time.monotonic()
        if killed_at is not None and len(gaps) < 3:
            gaps.append(now - last)
        last = now
        if chunk.choices:
            texts.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
        if i == 20:
            victim = _serving(stack)
            stack.kill(victim["name"])
            killed_at = time.monotonic()
    assert killed_at is not None
    assert usage.completion_tokens == MAX_TOKENS  # the full answer, through the other decode worker
    assert _resumes(stack) == resumes_before + 1
    assert max(gaps) < 5.0, f"the stream stalled {max(gaps):.1f}s after the kill"
    # greedy: resuming (re-prefill of prompt + tokens so far, replayed through the detokenizer)
    # continues the same text, with what the dead worker held back neither lost nor repeated
    assert "".join(texts) == reference.choices[0].text


def test_prefill_worker_killed_new_requests_fall_back(stack, client, model_name):
    for w in _alive(stack, "prefill"):
        stack.kill(w["name"])
    assert _alive(stack, "decode"), "needs a live decode worker"
    for _ in range(3):
        r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8
    with urllib.request.urlopen(stack.url + "/ready", timeout=5) as r:
        assert r.status == 200


@pytest.fixture(scope="module")
def lone_decode_stack(toy_model_dir):
    """A stack of its own: one prefill and one decode worker. On the shared stack the test before
    may have killed the prefill worker, and `tandem up` stops (router included) once every worker
    has exited, so the router could be gone before it answers the 503 this test asks for."""
    with LocalStack(toy_model_dir, "disaggregated", ["--kv-backend", "tcp", "--decode", "1"]) as s:
        yield s


def test_last_decode_worker_killed_mid_stream_ends_with_a_clean_error(lone_decode_stack, model_name):
    stack = lone_decode_stack
    client = _client(stack)
    assert len(_alive(stack, "decode")) == 1 and _alive(stack, "prefill"), "one decode worker, a live prefill one"
    stream = _stream(client, model_name)
    killed_at = None
    with pytest.raises(openai.APIError) as info:
        for i, _chunk in enumerate(stream):
            if i == 20:
                stack.kill(_serving(stack)["name"])
                killed_at = time.monotonic()
    assert killed_at is not None and time.monotonic() - killed_at < 5.0
    assert "decode worker failed" in str(info.value)
    # the router itself is fine and says it cannot serve
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4)
    assert info.value.status_code == 503
