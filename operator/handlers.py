"""The operator's entry points: what kopf calls, and nothing else. Read this file as a table of contents.

- an InferenceService event (created, changed, found at start-up, deleted) -> Controller.service_event
- a child Deployment, pod or download Job changed                         -> Controller.child_event

Each queues a pass of the controller's work queue (tandem.operator.controller), which also holds the
timers of the periodic resync, the planner (tandem.operator.autoscaling.autoscaler) and retries. A
pass reads the InferenceService, probes the ready workers' KV transfer health (tandem.operator.probe;
concurrent, short timeout), plans when due, applies and writes status (tandem.operator.reconcile).

Only event handlers: kopf then writes nothing on the InferenceService (no finalizer, no progress or
diff-base annotations), so deletion never waits for the operator. Children go away with the CR
through their ownerReferences and the garbage collector.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
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
from tandem.operator.children import READ_THREADS
from tandem.operator.controller import Controller

log = logging.getLogger(__name__)
CHILD_LABELS = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_SERVICE: kopf.PRESENT}


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Connect, and start the work queue's workers."""
    # Our own Events say what the operator did; kopf posts only its warnings and errors.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()
    # Passes wait on the API server far more than they compute: every worker gets a thread and a
    # connection of its own (asyncio's default executor has cores + 4 threads, the client 5 x cores).
    threads = memo.workers + 4
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(threads, thread_name_prefix="pass"))
    configuration = client.Configuration.get_default_copy()
    # One connection for every thread that may hold one at once: the passes' and the children's
    # readers (operator/children.py). Smaller, urllib3 discards connections past its size and the
    # next call opens another (TLS handshake and all): 7,000 discards in 5 minutes at 1,000 services.
    configuration.connection_pool_maxsize = threads + READ_THREADS
    memo.api = client.ApiClient(configuration)
    memo.controller = Controller(memo.api, memo.config, memo.workers)
    memo.queue_task = asyncio.create_task(memo.controller.queue.run())


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.queue_task.cancel()
    await asyncio.gather(memo.queue_task, return_exceptions=True)
    await memo.controller.close()
    memo.api.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def service_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Created, changed (a new generation), found at start-up, or deleted."""
    memo.controller.service_event(type, dict(body))


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("", "v1", "pods", labels=CHILD_LABELS)
@kopf.on.event("batch", "v1", "jobs", labels=CHILD_LABELS)
async def child_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child moved: its owner's status soon (coalesced per owner), or its drift corrected now."""
    memo.controller.child_event(body["metadata"]["namespace"], body["metadata"]["labels"][LABEL_SERVICE],
                                dict(body), type)
