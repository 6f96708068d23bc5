"""Leader election against a real kube-apiserver made slow or unreachable (issue 28 item 9).

The leader reaches the API server through a TCP proxy on loopback (tandem.testing.tcp_proxy) that
the test stalls (a server that answers nothing) or closes (connection refused); the standby talks
to the API server directly. The leader must stop leading at the renew deadline after the start of
its last successful renewal, whatever its calls in flight do, and before the standby leads; a
refused connection (urllib3's MaxRetryError, not an OSError) is a failed renewal, not an exit.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

import pytest
import yaml
from kubernetes import client, config
from tandem.operator.election import ElectionConfig
from tandem.operator.leader import LeaderElector, LeadershipLost
from tandem.testing.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Short timings (client-go's defaults are 15 s, 10 s, 2 s): the same proportions' hazards, in seconds.
DEADLINE_S = 2.0
LATE_S = 0.4  # how late past the deadline the stop may come on a busy test machine (event-loop wakeup)


@pytest.fixture
def proxy(k8s):
    url = urlparse(k8s.server)
    with TcpProxy((url.hostname, url.port)) as p:
        yield p


def via(k8s, proxy: TcpProxy, tmp_path) -> client.ApiClient:
    """The admin's client, reaching the API server through `proxy` (a kubeconfig of its own: the
    kubeconfig loader sets the host again before every call)."""
    kubeconfig = yaml.safe_load(k8s.kubeconfig.read_text())
    for entry in kubeconfig["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    path = tmp_path / "via-proxy.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    return config.new_client_from_config(config_file=str(path))


def election(namespace: str) -> ElectionConfig:
    return ElectionConfig(namespace, name="tandem-operator-test", duration_s=4, renew_deadline_s=DEADLINE_S,
                          retry_s=0.5)


class Stop:
    """When a keep() task ended, and how."""

    def __init__(self, task: asyncio.Task) -> None:
        self.at: float | None = None
        task.add_done_callback(lambda _: setattr(self, "at", time.monotonic()))


async def lead(api: client.ApiClient, namespace: str, me: str) -> tuple[LeaderElector, asyncio.Task, Stop]:
    leader = LeaderElector(api, election(namespace), me=me)
    await asyncio.wait_for(leader.acquire(), 10)
    keeper = asyncio.create_task(leader.keep())
    return leader, keeper, Stop(keeper)


async def renewed(leader: LeaderElector, after: float) -> None:
    """Until the leader's last successful renewal was sent after `after` (within 5 s)."""
    deadline = time.monotonic() + 5.0
    while leader.renewed_at <= after:
        assert time.monotonic() < deadline, "the leader did not renew through the proxy"
        await asyncio.sleep(0.05)


async def test_a_leader_whose_api_server_stalls_stops_by_its_deadline_before_the_standby_leads(
        k8s, namespace, proxy, tmp_path):
    with k8s.api_client() as api:
        leader, keeper, stop = await lead(via(k8s, proxy, tmp_path), namespace, "a")
        standby = LeaderElector(api, election(namespace), me="b")
        taking = asyncio.create_task(standby.acquire())
        try:
            await renewed(leader, time.monotonic())
            proxy.stall()  # every call from now on hangs, renewals already sent included
            with pytest.raises(LeadershipLost, match="not renewed for 2 s"):
                await asyncio.wait_for(keeper, DEADLINE_S + 5)
            last = leader.renewed_at
            assert not leader.leading
            assert last + DEADLINE_S - 0.05 <= stop.at <= last + DEADLINE_S + LATE_S, (
                f"stopped {stop.at - last:.2f} s after its last renewal was sent, deadline {DEADLINE_S} s")
            await asyncio.wait_for(taking, 10)
            took = time.monotonic()
            assert stop.at < took, "the standby led while the old leader still did"
            assert standby.renewed_at > stop.at, "the standby's winning write was sent after the leader stopped"
        finally:
            keeper.cancel()
            taking.cancel()
            await asyncio.gather(keeper, taking, return_exceptions=True)


async def test_a_refused_connection_is_a_failed_renewal_and_the_deadline_still_holds(
        k8s, namespace, proxy, tmp_path):
    leader, keeper, stop = await lead(via(k8s, proxy, tmp_path), namespace, "a")
    try:
        await renewed(leader, time.monotonic())
        proxy.refuse()  # connection refused: urllib3 raises MaxRetryError or NewConnectionError
        await asyncio.sleep(DEADLINE_S / 2)
        assert not keeper.done(), f"one refused connection ended the leader: {keeper.exception()!r}"
        proxy.restore()
        await renewed(leader, time.monotonic())  # a renewal sent after the API server came back
        assert not keeper.done() and leader.leading
        refused_at = time.monotonic()
        proxy.refuse()
        with pytest.raises(LeadershipLost, match="not renewed"):
            await asyncio.wait_for(keeper, DEADLINE_S + 5)
        last = leader.renewed_at
        assert last + DEADLINE_S - 0.05 <= stop.at <= last + DEADLINE_S + LATE_S, (
            f"stopped {stop.at - last:.2f} s after its last renewal ({stop.at - refused_at:.2f} s after the "
            f"API server became unreachable), deadline {DEADLINE_S} s")
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
