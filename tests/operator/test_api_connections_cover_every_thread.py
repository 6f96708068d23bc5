"""The operator's API client keeps a connection for every thread that may hold one at once.

Found by `python -m bench operator_scale --services 1000`: the passes' threads and the children's
reader threads (operator/children.py) share one client whose pool was sized for the passes only;
urllib3 discarded every connection past it ("Connection pool is full", about 7,000 times in 5
minutes) and the next call opened a new one, TLS handshake and all, on a control plane already
busy. Started as the operator starts (the startup handler, against the test control plane)."""

import asyncio

import kopf
import pytest
from kubernetes.config import kube_config
from tandem.operator import children, handlers
from tandem.operator.config import OperatorConfig
from tandem.operator.watch import WATCHED

pytestmark = [pytest.mark.cluster]


async def test_the_pool_holds_a_connection_for_every_pass_and_reader_thread(k8s, monkeypatch):
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(k8s.kubeconfig))
    memo = kopf.Memo(workers=16, config=OperatorConfig())
    indexes = {handlers.SERVICES_INDEX: {}, **{kind.index: {} for kind in WATCHED}}  # kopf's, empty at startup
    await handlers.startup(settings=kopf.OperatorSettings(), memo=memo, **indexes)
    try:
        passes = asyncio.get_running_loop()._default_executor._max_workers
        readers = children._reader()._max_workers
        assert memo.api.configuration.connection_pool_maxsize >= passes + readers
    finally:
        await handlers.cleanup(memo=memo)
