"""The operator's entry points: what kopf calls, and nothing else. Read this file as a table of contents.

- an InferenceService event (created, changed, found at start-up, deleted) -> Controller.service_event
- a child (a workload, pod, Job, Service, ConfigMap, ...) changed          -> Controller.child_event
- indexes of the same watches: the InferenceServices, and per kind the children by (namespace,
  service) (tandem.operator.watch): what a pass observes, instead of listing

Each event queues a pass of the controller's work queue (tandem.operator.controller), which also
holds the timers of the periodic resync, the planner (tandem.operator.autoscaling.autoscaler) and
retries. A pass (tandem.operator.reconcile) reads the InferenceService and its children from the
indexes, probes the ready workers' KV transfer health (tandem.operator.probe; concurrent, short
timeout), plans when due, applies and writes status.

Only event and index handlers: kopf then writes nothing on the InferenceService (no finalizer, no
progress or diff-base annotations), so deletion never waits for the operator. Children go away with
the CR through their ownerReferences and the garbage collector. The children's watches select by
label on the API server (CHILD_SELECTOR): the operator never receives another workload's objects.
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
from tandem.operator.api_client import throttled_credentials
from tandem.operator.children import READ_THREADS
from tandem.operator.controller import Controller
from tandem.operator.watch import WATCHED, Kind, Watched, kept, service_key

log = logging.getLogger(__name__)
CHILD_LABELS = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_SERVICE: kopf.PRESENT}
CHILD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_SERVICE}"
SERVICES_INDEX = "seen_inferenceservices"


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff-base: kopf builds one per event (a deep copy of the object) for handlers that react to
    changes of fields; the operator has only event and index handlers, and that copy was a sixth of
    its CPU while 100 services were created."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return None

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **indexes: Any) -> None:
    """Connect, and start the work queue's workers over kopf's indexes (empty until kopf has listed
    every watched kind: no other handler runs before that)."""
    # Our own Events say what the operator did; kopf posts only its warnings and errors.
    settings.posting.level = logging.WARNING
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    for kind in WATCHED:
        settings.watching.label_selectors[kind.group, kind.version, kind.plural] = CHILD_SELECTOR
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
    throttled_credentials(configuration)
    memo.api = client.ApiClient(configuration)
    watched = Watched(indexes[SERVICES_INDEX], {kind.index: indexes[kind.index] for kind in WATCHED})
    memo.controller = Controller(memo.api, memo.config, watched, memo.workers)
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


# Index handlers are coroutines: kopf runs a plain function in a thread, a hop per event.
@kopf.index(GROUP, VERSION, PLURAL, id=SERVICES_INDEX)
async def index_service(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict:
    return {(namespace, name): dict(body)}


def _indexer(kind: Kind) -> Any:
    async def index_child(body: kopf.Body, **_: Any) -> dict:
        return {service_key(body): kept(body, kind)}

    return index_child


async def child_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child moved: its owner's status soon (coalesced per owner), or its drift corrected now."""
    namespace, service = service_key(body)
    memo.controller.child_event(namespace, service, dict(body), type)


for _kind in WATCHED:  # one watch per kind: its index, and its events
    kopf.index(_kind.group, _kind.version, _kind.plural, labels=CHILD_LABELS, id=_kind.index)(_indexer(_kind))
    if _kind.applied or _kind.status:
        kopf.on.event(_kind.group, _kind.version, _kind.plural, labels=CHILD_LABELS,
                      id=f"changed_{_kind.plural}")(child_changed)
