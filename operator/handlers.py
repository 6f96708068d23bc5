"""The operator's entry points: what kopf calls, and nothing else. Read this file as a table of contents.

- InferenceService created / updated / found at startup -> reconcile (render, apply, status)
- every --resync-seconds, every InferenceService            -> reconcile (drift correction)
- a child Deployment or pod changed                          -> refresh the owner's status
- every spec.autoscaling.intervalSeconds, each autoscaled one -> plan replicas, write status, reconcile
                                                                (tandem.operator.autoscaler)

Before each of these writes status, probe_kv asks the ready workers for their KV transfer
health (tandem.operator.probe; concurrent, short timeout) for KVTransferReady.

No kopf finalizer is ever added: there is no on.delete handler and no kopf timer or daemon
(kopf adds a finalizer for those, which would block deletion while the operator is down).
The periodic resync and the autoscaler are operator-wide tasks instead. Children go away with
the CR through their ownerReferences and the garbage collector.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from kubernetes import client
from kubernetes import config as kube_config
from tandem.contracts.names import (
    GROUP,
    LABEL_MANAGED_BY,
    LABEL_SERVICE,
    MANAGED_BY,
    PLURAL,
    VERSION,
)
from tandem.operator import apply, probe
from tandem.operator.autoscaler import Autoscaler
from tandem.operator.reconcile import reconcile, refresh_status
from tandem.operator.status import KVProbe

log = logging.getLogger(__name__)
CHILD_LABELS = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_SERVICE: kopf.PRESENT}


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Annotations for kopf's bookkeeping (status stays ours); connect; start the resync."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="operator.tandem.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="operator.tandem.dev", key="last-handled-configuration"
    )
    # Our own Events say what the operator did; kopf posts only its warnings and errors.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()
    memo.api = client.ApiClient()
    memo.refresher = Refresher(memo)
    memo.autoscaler = Autoscaler(memo.api, memo.config)
    memo.resync_task = asyncio.create_task(resync_forever(memo))
    memo.autoscale_task = asyncio.create_task(memo.autoscaler.run_forever())


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.resync_task.cancel()
    memo.autoscale_task.cancel()
    memo.api.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_service(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Render and apply the children, then write status; retry only what retrying can fix."""
    memo.autoscaler.track(dict(body))
    kv = await probe_kv(memo, body["metadata"]["namespace"], body["metadata"]["name"])
    result = await asyncio.to_thread(reconcile, memo.api, dict(body), memo.config, False, kv)
    if result.error and result.retryable:
        raise kopf.TemporaryError(result.error, delay=10)
    if result.error:
        # Reported as Ready=False/ApplyFailed; the resync tries again after the next spec change.
        raise kopf.PermanentError(result.error)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("", "v1", "pods", labels=CHILD_LABELS)
def child_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child moved: refresh its owner's status soon (coalesced per owner)."""
    memo.refresher.request(body["metadata"]["namespace"], body["metadata"]["labels"][LABEL_SERVICE])


class Refresher:
    """Coalesces bursts of child events into one status refresh per owner."""

    def __init__(self, memo: kopf.Memo, delay: float = 0.5) -> None:
        self.memo, self.delay = memo, delay
        self.loop = asyncio.get_running_loop()
        self.pending: set[tuple[str, str]] = set()
        self.tasks: set[asyncio.Task] = set()

    def request(self, namespace: str, name: str) -> None:
        """Thread-safe: sync handlers run in kopf's executor threads."""
        self.loop.call_soon_threadsafe(self._schedule, (namespace, name))

    def _schedule(self, key: tuple[str, str]) -> None:
        if key in self.pending:
            return
        self.pending.add(key)
        task = asyncio.create_task(self._refresh(key))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _refresh(self, key: tuple[str, str]) -> None:
        await asyncio.sleep(self.delay)
        self.pending.discard(key)
        try:
            kv = await probe_kv(self.memo, *key)
            await asyncio.to_thread(refresh_status, self.memo.api, key[0], key[1], self.memo.config, kv)
        except Exception:
            log.exception("refreshing the status of %s/%s failed; the resync will retry", *key)


async def resync_forever(memo: kopf.Memo) -> None:
    """Level-triggered drift correction: re-apply every InferenceService every resync_seconds."""
    while True:
        await asyncio.sleep(memo.config.resync_seconds)
        try:
            items = await asyncio.to_thread(apply.list_services, memo.api, memo.namespaces)
        except Exception:
            log.exception("listing InferenceServices failed; retrying at the next resync")
            continue
        items = [b for b in items if not b["metadata"].get("deletionTimestamp")]
        for body in items:
            memo.autoscaler.track(body)
        # Every service's workers at once: a slow probe delays no one by more than its timeout.
        probes = await asyncio.gather(
            *(probe_kv(memo, b["metadata"]["namespace"], b["metadata"]["name"]) for b in items),
            return_exceptions=True,
        )
        for body, kv in zip(items, probes, strict=True):
            if isinstance(kv, BaseException):
                log.error("probing the KV health of %s/%s failed: %s", body["metadata"]["namespace"],
                          body["metadata"]["name"], kv)
                kv = None
            try:
                await asyncio.to_thread(reconcile, memo.api, body, memo.config, True, kv)
            except Exception:
                log.exception("resync of %s/%s failed", body["metadata"]["namespace"], body["metadata"]["name"])


async def probe_kv(memo: kopf.Memo, namespace: str, name: str) -> list[KVProbe] | None:
    """The ready workers' /internal/kv/health answers; None when probing is turned off."""
    if not memo.config.kv_probe:
        return None
    obs = await asyncio.to_thread(apply.observe, memo.api, namespace, name)
    return await probe.probe_all(probe.targets(obs), memo.config.kv_probe_timeout_s)
