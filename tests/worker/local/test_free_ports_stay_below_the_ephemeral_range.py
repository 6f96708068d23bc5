"""free_port picks below the OS's ephemeral range and never hands a port out twice: servers started
together (three vLLM servers, each binding its own ZMQ and NIXL sockets to ports the OS picks) once
lost a picked port to another's socket ("Address already in use") when free_port let the OS pick."""

from __future__ import annotations

import socket

import pytest
from tandem.worker.local import processes


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    span = processes._below_ephemeral()
    if span is None:
        pytest.skip("this kernel's ephemeral port range leaves no room below it")
    ports = [processes.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(span[0] <= p < span[1] for p in ports), (span, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_without_a_readable_range_the_os_picks(monkeypatch, tmp_path):
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    port = processes.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
