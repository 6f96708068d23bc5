"""Every trigger of the operator becomes a pass of one work queue, keyed by InferenceService.

    the InferenceService created, its spec changed, or seen at start-up -> apply + status
    its resync timer (every --resync-seconds, jittered)                 -> apply + status (drift)
    a child deleted, or changed by someone else                         -> apply + status (drift)
    a download Job deleted (how a failed download is retried)           -> apply + status
    a child workload, pod, Job or Service changed (coalesced for CHILD_DELAY_S) -> status
    its planner timer (every spec.autoscaling.intervalSeconds)          -> plan + status (+ apply)
    an apply failed in a way retrying can fix (after RETRY_S)           -> apply + status

The queue (workqueue.py) runs one pass at a time per service and merges what was asked twice, so
none of these races another, and nothing needs a lock. The pass itself is tandem.operator.reconcile's;
when it finds the InferenceService gone, everything kept for it (queued work, timers, the planner's
window, KV memory) goes.
"""

from __future__ import annotations

import logging
import random

from kubernetes import client
from tandem.operator import probe
from tandem.operator.autoscaling.autoscaler import Planning
from tandem.operator.children import drifted
from tandem.operator.config import OperatorConfig
from tandem.operator.metrics import METRICS, OperatorMetrics
from tandem.operator.reconcile import Outcome, PassContext, ServiceState, run_pass
from tandem.operator.watch import BY_KIND, Key, Watched
from tandem.operator.work import PLAN, RESYNC, RETRY, SPEC, STATUS, Work, merge
from tandem.operator.workqueue import WorkQueue

log = logging.getLogger(__name__)

CHILD_DELAY_S = 0.5  # a burst of child events (a rollout) is one status pass
RETRY_S = 10.0
RESYNC_JITTER = 0.1  # resyncs spread over +-10% of the period, so services do not all pass at once


class Controller:
    """The operator's work: the queue, its triggers, and the timers each pass leaves."""

    def __init__(self, api: client.ApiClient, config: OperatorConfig, watched: Watched, workers: int = 16,
                 metrics: OperatorMetrics = METRICS) -> None:
        self.config, self.metrics = config, metrics
        self.queue: WorkQueue[Key, Work] = WorkQueue(self.timed_pass, merge, workers, metrics.queue_wait.observe)
        self.services: dict[Key, ServiceState] = {}
        self.context = PassContext(api, config, watched, probe.new_session(), metrics)
        metrics.queue_depth.set_function(lambda: self.queue.depth)
        metrics.queue_active.set_function(lambda: self.queue.active)
        metrics.services.set_function(lambda: len(self.services))

    # -- triggers -----------------------------------------------------------------------------

    def service_event(self, event_type: str | None, body: dict) -> None:
        """kopf's watch of InferenceServices: a new generation (or a first sight) is applied."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if event_type == "DELETED":
            self.forget(key)
            return
        if meta.get("deletionTimestamp"):
            return  # the garbage collector removes the children
        state = self.services.setdefault(key, ServiceState())
        if state.generation != meta.get("generation"):
            state.generation = meta.get("generation")
            self.queue.add(key, SPEC)

    def child_event(self, namespace: str, service: str, body: dict, event_type: str | None = None) -> None:
        """A child of the service changed. One deleted, or changed by someone else (not what the
        operator's last apply left), is drift: applied again at once; so is a deleted download Job (a
        failed download is retried by deleting its Job). Otherwise a workload, pod, Job or Service
        change refreshes status soon (a burst is one pass), and anything else needs nothing."""
        key = (namespace, service)
        kind = BY_KIND.get(body.get("kind", ""))
        if kind is None:
            return
        if kind.applied and self._drifted(key, body, event_type):
            self.queue.add(key, RESYNC)
        elif kind.status:
            self.queue.schedule(key, STATUS, CHILD_DELAY_S, "child")

    def _drifted(self, key: Key, body: dict, event_type: str | None) -> bool:
        if body["kind"] == "Job" and event_type == "DELETED":
            return True
        state = self.services.get(key)
        last = state.memory.applied.get(f"{body['kind']}/{body['metadata']['name']}") if state else None
        if last is None:
            return False  # not applied by this process yet: its first pass applies anyway
        return event_type == "DELETED" or drifted(body, last)

    async def close(self) -> None:
        await self.context.session.close()

    def forget(self, key: Key) -> None:
        """Everything kept for a service that is gone."""
        self.queue.forget(key)
        self.services.pop(key, None)
        self.metrics.forget(*key)

    # -- one pass -----------------------------------------------------------------------------

    async def timed_pass(self, key: Key, work: Work) -> None:
        """A pass (tandem.operator.reconcile.run_pass), counted and timed by who asked for it; then
        the timers for the next ones."""
        trigger = work.trigger.value
        self.metrics.reconciles.labels(trigger).inc()
        with self.metrics.reconcile_seconds.labels(trigger).time():
            try:
                state = self.services.get(key)
                if state is None:  # first seen through a child or a timer: its spec is applied too
                    state = self.services[key] = ServiceState()
                    work = merge(work, SPEC)
                outcome = await run_pass(self.context, key, work, state)
            except Exception:
                self.metrics.reconcile_errors.labels(trigger, "Exception").inc()
                raise
        if outcome is None:
            self.forget(key)
            return
        if outcome.error is not None:
            self.metrics.reconcile_errors.labels(trigger, outcome.error).inc()
        if key in self.services:  # not forgotten while the pass ran
            self._next_passes(key, work, state, outcome)

    def _next_passes(self, key: Key, work: Work, state: ServiceState, outcome: Outcome) -> None:
        """A retry when the apply failed in a way retrying can fix; the resync; the planner's timer."""
        result = outcome.result
        if result.error and result.retryable:
            log.warning("%s/%s: %s; retrying in %.0f s", *key, result.error, RETRY_S)
            self.queue.schedule(key, RETRY, RETRY_S, "retry")
        if not self.queue.scheduled(key, "resync"):
            jitter = random.uniform(1 - RESYNC_JITTER, 1 + RESYNC_JITTER)
            self.queue.schedule(key, RESYNC, self.config.resync_seconds * jitter, "resync")
        autoscaling = outcome.spec.autoscaling if outcome.spec is not None else None
        if autoscaling is None:
            state.planning = Planning()
        elif work.plan:
            self.queue.schedule(key, PLAN, autoscaling.interval_s, "plan")
        elif not self.queue.scheduled(key, "plan"):
            self.queue.schedule(key, PLAN, 0.0, "plan")
