"""Transfer health tells a working handoff path from a wedged one, and RDMA from a silent TCP fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tandem.testing.kv_peer import SMALL_LAYOUT, KVPeer
from tandem.worker.kv.base import KVTransferConfig, KVTransferError
from tandem.worker.kv.health import KVTransferMetrics, TransferHealth, detect_ucx_transport


def test_health_tracks_success_failure_and_recent_bandwidth() -> None:
    reg = CollectorRegistry()
    h = TransferHealth("tcp", "e-1", KVTransferMetrics(reg))
    assert h.report().healthy and h.bandwidth() is None
    h.success("pull", 1_000_000, 0.5)
    h.success("pull", 3_000_000, 0.5)
    assert h.bandwidth() == pytest.approx(4_000_000)
    h.failure("pull", "peer gone")
    d = h.report()
    assert not d.healthy and d.last_error == "peer gone" and d.failures_total == {"pull": 1}
    h.success("pull", 10, 0.001)
    assert h.report().healthy  # recovered
    labels = {"backend": "tcp", "direction": "pull"}
    assert reg.get_sample_value("tandem_kv_transfer_bytes_total", labels) == 4_000_010
    assert reg.get_sample_value("tandem_kv_transfer_failures_total", labels) == 1
    assert reg.get_sample_value("tandem_kv_transfer_seconds_count", labels) == 3
    assert reg.get_sample_value("tandem_kv_transfer_last_success_timestamp_seconds", labels) > 0
    assert reg.get_sample_value("tandem_kv_transfer_rdma_in_use", {"backend": "tcp"}) == 0


def test_two_transports_share_one_registry_s_metrics() -> None:
    reg = CollectorRegistry()
    metrics = KVTransferMetrics(reg)  # made once by the registry's owner
    TransferHealth("tcp", "a", metrics).success("pull", 5, 0.1)
    TransferHealth("tcp", "b", metrics).success("pull", 7, 0.1)
    assert reg.get_sample_value("tandem_kv_transfer_bytes_total",
                                {"backend": "tcp", "direction": "pull"}) == 12


def _sysfs(tmp_path: Path, *devices: str) -> Path:
    root = tmp_path / "infiniband"
    root.mkdir()
    for d in devices:
        (root / d).mkdir()
    return root


def test_rdma_detected_only_with_a_device_and_tls_allowing_it(tmp_path: Path) -> None:
    ib = _sysfs(tmp_path, "mlx5_0", "mlx5_1")
    assert detect_ucx_transport({}, ib).rdma  # UCX_TLS unset: UCX picks RDMA when a device exists
    assert detect_ucx_transport({"UCX_TLS": "rc_x,rc,dc_x,dc,cuda_copy"}, ib).rdma
    assert detect_ucx_transport({"UCX_TLS": "all"}, ib).rdma
    tcp = detect_ucx_transport({"UCX_TLS": "tcp"}, ib)
    assert not tcp.rdma and tcp.network == "tcp" and "excludes" in tcp.reason
    assert not detect_ucx_transport({"UCX_TLS": "^rc,dc,ud,rc_x,dc_x,ud_x"}, ib).rdma
    assert not detect_ucx_transport({"UCX_NET_DEVICES": "eth0"}, ib).rdma
    assert detect_ucx_transport({"UCX_NET_DEVICES": "mlx5_1:1"}, ib).rdma


def test_no_rdma_device_means_tcp_fallback_and_says_how_it_knows(tmp_path: Path) -> None:
    d = detect_ucx_transport({"UCX_TLS": "rc,tcp"}, _sysfs(tmp_path))
    assert not d.rdma and "no RDMA device" in d.reason and "UCX_TLS" in d.detected_by
    assert not detect_ucx_transport({}, tmp_path / "missing").rdma


async def test_transport_health_and_metrics_after_real_pulls() -> None:
    reg = CollectorRegistry()
    cfg = KVTransferConfig(backend="memory", extra={"kv_metrics": KVTransferMetrics(reg)})
    p = KVPeer("memory", SMALL_LAYOUT, "h-prefill", cfg)
    d = KVPeer("memory", SMALL_LAYOUT, "h-decode", cfg, fill=False)
    await p.start()
    await d.start()
    try:
        assert (await d.pull("ok", p.prefill("ok", 160, seed=1), seed=1))["ok"]
        with pytest.raises(KVTransferError):
            await d.transport.pull("bad", p.prefill("bad", 16, seed=1), [0, 1])
        h = d.transport.health()
        assert h.transfers_total == {"pull": 1} and h.failures_total == {"pull": 1}
        assert h.recent_bandwidth_bytes_per_second > 0 and h.transport.rdma is False
        text = generate_latest(reg).decode()
        for name in ("tandem_kv_transfer_bytes_total", "tandem_kv_transfer_seconds_bucket",
                     "tandem_kv_transfer_failures_total", "tandem_kv_transfer_rdma_in_use",
                     "tandem_kv_transfer_last_success_timestamp_seconds"):
            assert name in text
        assert reg.get_sample_value("tandem_kv_transfer_bytes_total",
                                    {"backend": "memory", "direction": "pull"}) == 10 * SMALL_LAYOUT.block_bytes
    finally:
        await p.close()
        await d.close()


def test_nixl_health_reports_the_ucx_transport_in_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("nixl_cu12", reason="needs the nixl package (nixl-cu12)")
    import torch
    from tandem.worker.kv.nixl import NixlTransport
    monkeypatch.setenv("UCX_TLS", "tcp")
    t = NixlTransport(torch.zeros(SMALL_LAYOUT.shape), SMALL_LAYOUT, "n-1",
                      KVTransferConfig())
    tr = t.health().transport
    assert tr.rdma is False and tr.ucx_tls == "tcp" and tr.nixl_backend == "UCX"
