"""The timing defaults that hold across processes (contracts/timing.py) keep their rules, each rule
catches the values that break it, and every process's own default is the contract's value."""

from __future__ import annotations

import inspect

import pytest
from tandem.contracts import timing


def test_the_defaults_keep_every_cross_process_rule():
    assert timing.violations() == []


@pytest.mark.parametrize(("values", "names"), [
    ({"heartbeat_s": 8.0}, ["heartbeat_s", "chunk_timeout_s"]),
    ({"chunk_timeout_s": 9.0}, ["heartbeat_s"]),  # also below reserve wait + pull
    ({"kv_reserve_wait_s": 6.0}, ["kv_reserve_wait_s", "kv_timeout_s", "chunk_timeout_s"]),
    ({"kv_transfer_timeout_s": 14.0}, ["kv_timeout_s"]),
    ({"prefill_queue_s": 60.0}, ["prefill_queue_s", "prefill_timeout_s"]),
    ({"kv_lease_s": 20.0}, ["busy_wait_s", "kv_lease_s"]),
    ({"busy_wait_s": 25.0}, ["busy_wait_s", "kv_lease_s"]),
    ({"vllm_kv_lease_s": 12}, ["busy_wait_s", "connect_timeout_s", "vllm_kv_lease_s"]),
])
def test_each_rule_names_the_settings_it_breaks(values, names):
    broken = timing.violations(**values)
    assert broken, values
    assert all(any(name in message for message in broken) for name in names)


def test_every_process_defaults_to_the_contract():
    from tandem.operator.render.config_files import KV_LEASE_S
    from tandem.router.config import RouterConfig
    from tandem.router.journey import Rules
    from tandem.router.worker_client import Timeouts
    from tandem.worker.kv.base import KVTransferConfig
    from tandem.worker.server.config import WorkerConfig
    from tandem.worker.server.state import WorkerSettings

    router, client = RouterConfig(), Timeouts()
    assert (router.chunk_timeout_s, client.chunk_s) == (timing.CHUNK_TIMEOUT_S,) * 2
    assert (router.prefill_timeout_s, client.prefill_s) == (timing.PREFILL_TIMEOUT_S,) * 2
    assert (router.connect_timeout_s, client.connect_s) == (timing.CONNECT_TIMEOUT_S,) * 2
    assert router.busy_wait_s == inspect.signature(Rules).parameters["busy_wait_s"].default == timing.BUSY_WAIT_S
    worker = WorkerConfig(model="unused")
    settings = WorkerSettings(role=worker.role, advertise_url="http://w", engine_id="w-1")
    assert worker.heartbeat_s == settings.heartbeat_s == timing.HEARTBEAT_S
    assert worker.kv_reserve_wait_s == settings.reserve_wait_s == timing.KV_RESERVE_WAIT_S
    assert worker.prefill_queue_s == settings.prefill_queue_s == timing.PREFILL_QUEUE_S
    kv = KVTransferConfig(backend="tcp")
    assert worker.kv_timeout_s == kv.timeout_s == timing.KV_TRANSFER_TIMEOUT_S
    assert worker.kv_lease_s == kv.lease_s == KV_LEASE_S == timing.KV_LEASE_S


def test_the_engine_defaults_to_the_contracts_lease():
    from tandem.worker.engine.engine import Engine

    assert inspect.signature(Engine).parameters["lease_s"].default == timing.KV_LEASE_S
