"""Every trigger of the operator becomes a pass of one work queue, keyed by InferenceService.

    the InferenceService created, its spec changed, or seen at start-up -> apply + status
    its resync timer (every --resync-seconds, jittered)                 -> apply + status (drift)
    a child Deployment deleted or changed by someone else               -> apply + status (drift)
    a download Job deleted (how a failed download is retried)           -> apply + status
    a child Deployment, pod or Job changed (coalesced for CHILD_DELAY_S) -> status
    its planner timer (every spec.autoscaling.intervalSeconds)          -> plan + status (+ apply)
    an apply failed in a way retrying can fix (after RETRY_S)           -> apply + status

The queue (workqueue.py) runs one pass at a time per service and merges what was asked twice, so
none of these races another, and nothing needs a lock. A pass reads the InferenceService afresh; when
it is gone, everything kept for it (queued work, timers, the planner's window, KV memory) goes.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

import aiohttp
from kubernetes import client
from tandem.operator import apply, probe, router_parity
from tandem.operator.autoscaling.autoscaler import Planning, decide
from tandem.operator.config import OperatorConfig
from tandem.operator.metrics import METRICS, OperatorMetrics
from tandem.operator.observe import observe
from tandem.operator.reconcile import Memory, act, conclude, parse_spec
from tandem.operator.spec import WORKER_ROLES
from tandem.operator.work import PLAN, RESYNC, RETRY, SPEC, STATUS, Trigger, Work, merge
from tandem.operator.workqueue import WorkQueue

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (namespace, name)

CHILD_DELAY_S = 0.5  # a burst of child events (a rollout) is one status pass
RETRY_S = 10.0
RESYNC_JITTER = 0.1  # resyncs spread over +-10% of the period, so services do not all pass at once


@dataclass
class ServiceState:
    """What the operator keeps per InferenceService between passes (dropped when it is deleted)."""

    generation: int | None = None  # the newest metadata.generation queued for applying
    memory: Memory = field(default_factory=Memory)
    planning: Planning = field(default_factory=Planning)


class Controller:
    """The operator's work: the queue, its triggers, and one pass."""

    def __init__(self, api: client.ApiClient, config: OperatorConfig, workers: int = 16,
                 metrics: OperatorMetrics = METRICS) -> None:
        self.api, self.config, self.metrics = api, config, metrics
        self.queue: WorkQueue[Key, Work] = WorkQueue(self.timed_pass, merge, workers, metrics.queue_wait.observe)
        self.services: dict[Key, ServiceState] = {}
        self.session: aiohttp.ClientSession | None = None  # pod answers, one pool for the process
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

    def child_event(self, namespace: str, service: str, body: dict | None = None,
                    event_type: str | None = None) -> None:
        """A Deployment, pod or download Job of the service changed: its status, soon (a burst is one
        pass). A Deployment deleted, or whose spec someone else changed (a generation the operator's
        last apply did not leave), is drift: applied again at once, not at the next resync; so is a
        deleted Job (a failed download is retried by deleting its Job)."""
        key = (namespace, service)
        kind = body.get("kind") if body is not None else None
        if (kind == "Deployment" and self._drifted(key, body, event_type)) or (
                kind == "Job" and event_type == "DELETED"):
            self.queue.add(key, RESYNC)
            return
        self.queue.schedule(key, STATUS, CHILD_DELAY_S, "child")

    def _drifted(self, key: Key, body: dict, event_type: str | None) -> bool:
        state = self.services.get(key)
        last = state.memory.applied.get(f"Deployment/{body['metadata']['name']}") if state else None
        if last is None:
            return False  # not applied by this process yet: its first pass applies anyway
        return event_type == "DELETED" or body["metadata"].get("generation") != last.generation

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def forget(self, key: Key) -> None:
        """Everything kept for a service that is gone."""
        self.queue.forget(key)
        self.services.pop(key, None)
        self.metrics.forget(*key)

    # -- one pass -----------------------------------------------------------------------------

    async def timed_pass(self, key: Key, work: Work) -> None:
        """run_pass, counted and timed by who asked for it."""
        trigger = work.trigger.value
        self.metrics.reconciles.labels(trigger).inc()
        with self.metrics.reconcile_seconds.labels(trigger).time():
            try:
                error = await self.run_pass(key, work)
            except Exception:
                self.metrics.reconcile_errors.labels(trigger, "Exception").inc()
                raise
        if error is not None:
            self.metrics.reconcile_errors.labels(trigger, error).inc()

    async def run_pass(self, key: Key, work: Work) -> str | None:
        """Read, (plan), apply, status; then the timers for the next passes. Returns the reason of an
        error the pass reported in status (ApplyFailed, AdoptionRefused, InvalidSpec), or None."""
        body = await asyncio.to_thread(apply.get_service, self.api, *key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(key)
            return None
        state = self.services.get(key)
        if state is None:  # first seen through a child or a timer: its spec is applied too
            state = self.services[key] = ServiceState(generation=body["metadata"].get("generation"))
            work = merge(work, SPEC)
        spec, spec_error = parse_spec(body)
        uid, memory = body["metadata"].get("uid"), state.memory
        groups = spec is None or any(spec.role(r).parallelism.spans_nodes for r in WORKER_ROLES)
        decision = kv = before = None
        if self.session is None:
            self.session = probe.new_session()
        if (work.plan and spec is not None) or work.trigger is Trigger.RESYNC:
            # The planner decides from the pods as they are now; a resync applies over the workloads
            # just listed (no GET each) and, finding nothing to change, reports on the same list.
            before = await asyncio.to_thread(observe, self.api, *key, uid, memory.owners, groups)
        if work.plan and spec is not None and before is not None:
            decision, kv = await decide(state.planning, uid, spec, before, self.config, self.session)
            if decision is not None:
                self.metrics.decided(*key, decision, state.planning.snapshot)
        acted = await asyncio.to_thread(act, self.api, body, self.config, work, memory, decision, before)
        obs = before if before is not None and acted.unchanged else await asyncio.to_thread(
            observe, self.api, *key, uid, memory.owners, groups)
        if kv is None:
            kv = await probe.probe_workers(obs, self.config, self.session)
        parity = await router_parity.read_routers(obs, self.config, self.session)
        await asyncio.to_thread(conclude, self.api, body, self.config, memory, acted, obs, decision, kv, parity)
        result = acted.result
        if work.trigger is Trigger.SPEC:
            log.info("%s/%s: generation %s reconciled%s", *key, body["metadata"].get("generation"),
                     f" ({result.error})" if result.error else "")
        if key not in self.services:
            return None  # forgotten while the pass ran
        if result.error and result.retryable:
            log.warning("%s/%s: %s; retrying in %.0f s", *key, result.error, RETRY_S)
            self.queue.schedule(key, RETRY, RETRY_S, "retry")
        if not self.queue.scheduled(key, "resync"):
            jitter = random.uniform(1 - RESYNC_JITTER, 1 + RESYNC_JITTER)
            self.queue.schedule(key, RESYNC, self.config.resync_seconds * jitter, "resync")
        autoscaling = spec.autoscaling if spec is not None else None
        if autoscaling is None:
            state.planning = Planning()
        elif work.plan:
            self.queue.schedule(key, PLAN, autoscaling.interval_s, "plan")
        elif not self.queue.scheduled(key, "plan"):
            self.queue.schedule(key, PLAN, 0.0, "plan")
        return ("InvalidSpec" if spec_error else result.reason) if result.error else None
