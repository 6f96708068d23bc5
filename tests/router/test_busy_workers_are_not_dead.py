"""Overload between real processes: a decode worker answering 429 (or 503 with Retry-After) is busy,
not dead. The router serves through another worker and never marks the busy one failed; when every
worker is busy the client gets a 503 with Retry-After. Workers are paced stand-ins
(tandem.testing.paced_worker) switched to refusing on demand; the router is `tandem router`."""

from __future__ import annotations

import json
import urllib.request

import pytest
from tandem.testing.hostile_json import dumps, post
from tandem.testing.paced_worker import start_paced_worker
from tandem.testing.router_process import RouterProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _set_mode(worker, **mode) -> None:
    req = urllib.request.Request(worker.url + "/test/mode", data=json.dumps(mode).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def test_busy_workers_are_skipped_never_failed_and_all_busy_is_a_503():
    a = start_paced_worker("--tokens", "3", "--interval-s", "0.01")
    b = start_paced_worker("--tokens", "3", "--interval-s", "0.01")
    r = RouterProcess("--decode", a.url, "--decode", b.url, "--policy", "round-robin").start()
    try:
        _set_mode(a, busy=True, status=429, retry_after=3)
        body = dumps({"model": "paced", "prompt": "hi", "max_tokens": 3})
        for _ in range(4):
            answer = post(r.url, "/v1/completions", body)
            assert answer.status == 200 and answer.json()["choices"][0]["text"] == " t0 t1 t2"
        assert json.loads(a.get_text("/test/stats"))["busy"] >= 2  # round-robin sent it its turns
        assert r.metric('tandem_router_worker_busy_total{role="decode"}') >= 2
        assert r.metric('tandem_router_worker_failures_total{role="decode"}') == 0
        assert r.get_json("/ready")["workers"]["decode"] == {"ready": 2, "total": 2}

        _set_mode(b, busy=True, status=503, retry_after=2)
        for stream in (False, True):
            answer = post(r.url, "/v1/completions", dumps({"model": "paced", "prompt": "hi", "max_tokens": 3,
                                                           "stream": stream}))
            assert answer.status == 503 and answer.headers["retry-after"] == "2"
            assert openai_error_body(answer)["code"] == "server_overloaded"
        assert r.get_json("/ready")["workers"]["decode"] == {"ready": 2, "total": 2}

        _set_mode(a, busy=False)
        assert post(r.url, "/v1/completions", body).status == 200
    finally:
        r.kill()
        a.kill()
        b.kill()


def openai_error_body(answer) -> dict:
    """The error object of a (5xx) answer in OpenAI's format."""
    assert answer.content_type.startswith("application/json")
    err = answer.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err
