"""A streaming client that stays connected but stops reading is dropped by the router within its
write timeout, and its request is aborted on the worker (not left to run to max_tokens while
buffers fill). The router is the real `tandem router` process with a small per-connection send
buffer; the worker is a paced stand-in (tandem.testing.paced_worker: 2,000 tokens, one every
10 ms), so the stream outlasts the write timeout however fast a real model would be; the client is
a raw socket with a small receive buffer that reads the first event and then nothing."""

from __future__ import annotations

import json
import socket

import pytest
from tandem.testing.cluster import wait_until
from tandem.testing.hostile_json import dumps
from tandem.testing.paced_worker import start_paced_worker
from tandem.testing.router_process import RouterProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted():
    worker = start_paced_worker("--tokens", "2000", "--interval-s", "0.01")
    router = RouterProcess("--decode", worker.url, "--write-timeout-s", "1",
                           "--stream-send-buffer-bytes", "8192").start()

    def stats() -> dict[str, int]:
        return json.loads(worker.get_text("/test/stats"))

    body = dumps({"model": "paced", "prompt": "A stream nobody reads", "max_tokens": 2000, "stream": True})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.settimeout(60)
    try:
        sock.connect(("127.0.0.1", router.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:  # the stream started: the request is running on the worker
            got += sock.recv(256)
        assert got.startswith(b"HTTP/1.1 200")
        # From here on the client reads nothing, and stays connected.
        wait_until(lambda: stats()["aborts"] >= 1, timeout=15, what="the router to abort the request on the worker", interval=0.05)
        assert stats()["finished"] == 0, "the stream must not have run to max_tokens"
        wait_until(lambda: stats()["open"] == 0, timeout=10, what="the worker's stream to close", interval=0.05)
        assert router.metric('tandem_requests_total{status="499"}') == 1
    finally:
        sock.close()
        router.kill()
        worker.kill()
