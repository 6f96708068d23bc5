"""Graceful router shutdown: on SIGTERM the router stops being ready and refuses new requests at once,
lets a 20 s stream in flight finish, and only then exits (0). The worker is a paced stand-in
(tandem.testing.paced_worker: 200 tokens, one every 0.1 s), so the stream outlasts any default
shutdown timeout whatever the machine's load; the router is the real `tandem router` process.
"""

from __future__ import annotations

import http.client
import json
import signal

import pytest
from tandem.testing.cluster import wait_until
from tandem.testing.hostile_json import dumps, post
from tandem.testing.paced_worker import start_paced_worker
from tandem.testing.router_process import RouterProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_20_s_stream_finishes_after_sigterm_and_then_the_router_exits():
    worker = start_paced_worker("--tokens", "200", "--interval-s", "0.1")
    r = RouterProcess("--decode", worker.url, "--shutdown-grace-s", "120").start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=60)
        conn.request("POST", "/v1/completions", dumps({"model": "paced", "prompt": "hi", "max_tokens": 200,
                                                        "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        r.signal(signal.SIGTERM)
        wait_until(lambda: r.status("/ready") == 503, timeout=10, what="/ready to turn 503", interval=0.05)
        refused = post(r.url, "/v1/completions", dumps({"model": "paced", "prompt": "late", "max_tokens": 1}))
        assert refused.status == 503 and refused.headers["retry-after"]
        assert r.alive(), "the router must wait for the stream in flight"
        rest = resp.read().decode()
        events = [e[6:] for e in (first.decode() + rest).split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == "".join(f" t{i}" for i in range(200))
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert r.proc.wait(timeout=30) == 0
        assert json.loads(worker.get_text("/test/stats"))["finished"] == 1
    finally:
        r.kill()
        worker.kill()
