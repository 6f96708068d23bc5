"""Overload between real processes: a `tandem worker` with one seat and no queue (--max-num-seqs 1
--max-waiting 0) answers a request it has no room for with 429 and Retry-After; the `tandem router`
in front takes that as busy, gives the client a 503 with Retry-After, never marks the worker failed,
and serves through it again once the seat is free."""

from __future__ import annotations

import http.client
import json

import pytest
from tandem.testing.hostile_json import dumps, post
from tandem.testing.router_process import RouterProcess
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_overload_is_busy_not_failed(toy_model_dir):
    worker = WorkerProcess(toy_model_dir, "colocated", "--max-num-seqs", "1", "--max-waiting", "0",
                           "--compile", "off")
    router = RouterProcess("--decode", worker.url)
    try:
        worker.start()
        router.start()
        model = toy_model_dir.name
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
        conn.request("POST", "/v1/completions", dumps({
            "model": model, "prompt": "Hold the seat", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
        first = conn.getresponse()
        assert first.status == 200 and first.readline().startswith(b"data: ")  # it holds the seat
        body = dumps({"model": model, "prompt": "No room", "max_tokens": 5, "ignore_eos": True, "temperature": 0})
        answer = post(router.url, "/v1/completions", body, timeout_s=60)
        assert answer.status == 503 and answer.headers["retry-after"] == "1", answer.body[:300]
        assert answer.json()["error"]["code"] == "server_overloaded"
        assert _metric(worker.get_text("/metrics"), 'tandem_worker_requests_refused_total{reason="queue_full"}') >= 1
        assert router.metric('tandem_router_worker_busy_total{role="decode"}') >= 1
        assert router.metric('tandem_router_worker_failures_total{role="decode"}') == 0
        assert router.get_json("/ready")["workers"]["colocated"] == {"ready": 1, "total": 1}
        rest = first.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in rest
        answer = post(router.url, "/v1/completions", body, timeout_s=60)
        assert answer.status == 200 and answer.json()["usage"]["completion_tokens"] == 5
        assert json.loads(worker.get_text("/internal/info"))["running"] == 0
    finally:
        router.kill()
        worker.kill()
