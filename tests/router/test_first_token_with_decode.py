"""`--first-token with-decode` through real processes: a router holding each handoff's first token
until the decode worker's first streams, over the disaggregated stack's own workers, answers
exactly what the colocated worker does (completions, streamed chat, several choices), every request
handed off (its route metric). When the first token goes out is the decision's, tested as one:
test_request_state_machine.py `with_decode`."""

from __future__ import annotations

import os
import sys
import urllib.request

import openai
import pytest
from tandem.contracts.internal_auth import SECRET_ENV
from tandem.worker.local.processes import ManagedProcess, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "Kubernetes schedules pods onto nodes, and an operator reconciles what it observes. " * 3


@pytest.fixture(scope="module")
def holding_router(disagg_stack, tmp_path_factory):
    port = free_port()
    argv = [sys.executable, "-m", "tandem.cli.main", "router", "--host", "127.0.0.1", "--port", str(port),
            "--first-token", "with-decode", "--no-parity-probe"]
    for role in ("prefill", "decode"):
        argv += [a for w in disagg_stack.workers(role) for a in (f"--{role}", w["url"])]
    router = ManagedProcess("router-with-decode", argv, os.environ | {SECRET_ENV: disagg_stack.secret},
                            url=f"http://127.0.0.1:{port}",
                            log_path=tmp_path_factory.mktemp("first-token") / "router.log")
    router.start()
    try:
        router.wait_ready()
        yield router
    finally:
        router.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _handoffs(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("tandem_router_routes_total{") and 'route="disaggregated"' in line)


def test_completions_and_choices_equal_colocated_and_are_handed_off(holding_router, colocated_client, model_name):
    router = _client(holding_router.url)
    before = _handoffs(holding_router.url)
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    got, want = router.completions.create(n=2, **kw), colocated_client.completions.create(**kw)
    assert [c.text for c in got.choices] == [want.choices[0].text] * 2
    assert got.usage.completion_tokens == 48 and got.usage.prompt_tokens == want.usage.prompt_tokens
    assert _handoffs(holding_router.url) - before >= 2, "the requests were not handed off: nothing was held"


def test_streamed_chat_equals_colocated(holding_router, colocated_client, model_name):
    kw = dict(model=model_name, max_tokens=16, temperature=0, extra_body={"ignore_eos": True},
              messages=[{"role": "user", "content": PROMPT}])
    chunks = list(_client(holding_router.url).chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    want = colocated_client.chat.completions.create(**kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens
