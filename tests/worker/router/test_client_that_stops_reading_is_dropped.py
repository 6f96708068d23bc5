"""A streaming client that stays connected but stops reading is dropped by the router within its
write timeout, and its sequence is aborted on the worker (not left to run to max_tokens while
buffers fill). A real `tandem up` stack (colocated, toy model) whose router bounds each streaming
connection's send buffer; the client is a raw socket with a small receive buffer that reads the
first event and then nothing."""

from __future__ import annotations

import json
import socket
import time

import pytest
from tandem.testing.local_stack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(toy_model_dir):
    with LocalStack(toy_model_dir, "colocated", ["--router-arg=--write-timeout-s=1",
                                                 "--router-arg=--stream-send-buffer-bytes=8192"]) as s:
        yield s


def _finished(stack: LocalStack, reason: str) -> float:
    (worker,) = stack.workers()
    from urllib.request import urlopen

    with urlopen(worker["url"] + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f'tandem_worker_requests_finished_total{{finish_reason="{reason}"}}'):
                return float(line.split()[-1])
    return 0.0


def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_client_that_stops_reading_is_dropped_and_its_sequence_aborted(stack, model_name):
    aborted_before = _finished(stack, "abort")
    body = json.dumps({"model": model_name, "prompt": "A stream nobody reads", "max_tokens": 1800,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.settimeout(60)
    try:
        sock.connect(("127.0.0.1", stack.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:  # the stream started: the sequence is running
            got += sock.recv(256)
        assert got.startswith(b"HTTP/1.1 200")
        # From here on the client reads nothing, and stays connected.
        _until(lambda: _finished(stack, "abort") > aborted_before, 60, "the worker to abort the sequence")
        (worker,) = stack.workers()
        info = stack.info(worker["url"])
        assert info["running"] == info["waiting"] == 0
        assert info["kv_blocks_free"] == info["kv_blocks_total"]
        assert _finished(stack, "length") == 0, "the stream must not have run to max_tokens"
    finally:
        sock.close()
