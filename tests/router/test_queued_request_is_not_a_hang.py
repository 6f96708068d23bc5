"""A request that waits in a worker's queue longer than the router's between-line timeout is not
taken for a hung worker: the worker's heartbeat lines keep the stream alive, the request is served
when its turn comes, and the worker is never counted as failed. Real processes: a colocated worker
with room for one sequence, heartbeats every 0.2 s, and a router that allows 1 s of silence."""

from __future__ import annotations

import http.client
import json

import pytest
from tandem.testing.hostile_json import dumps, post
from tandem.testing.router_process import RouterProcess
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_queued_request_outwaits_the_chunk_timeout(toy_model_dir, model_name):
    worker = WorkerProcess(toy_model_dir, "colocated", "--max-num-seqs", "1", "--heartbeat-s", "0.2")
    router = RouterProcess("--decode", worker.url, "--chunk-timeout-s", "1")
    try:
        worker.start()
        router.start()
        # the first request holds the only sequence slot for 1500 tokens: seconds, at any speed here
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
        conn.request("POST", "/v1/completions", dumps({
            "model": model_name, "prompt": "Hold the slot", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
        first = conn.getresponse()
        assert first.status == 200 and first.readline().startswith(b"data: ")
        answer = post(router.url, "/v1/completions", dumps({
            "model": model_name, "prompt": "Wait your turn", "max_tokens": 5, "ignore_eos": True,
            "temperature": 0}), timeout_s=120)
        assert answer.status == 200, answer.body[:300]
        assert answer.json()["usage"]["completion_tokens"] == 5
        body = first.read().decode()
        assert body.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in body
        assert router.metric('tandem_router_worker_failures_total{role="decode"}') == 0
        assert router.metric("tandem_router_decode_resumes_total") == 0
        assert json.loads(worker.get_text("/internal/info"))["running"] == 0
    finally:
        router.kill()
        worker.kill()


