"""One pass over one InferenceService (`run_pass`): read it, observe its children from the watch,
(plan), `act` (the planner's decision, the model check, render, apply), observe again what the apply
returned, read the routers' reports (handoff parity, the workers' KV health), conclude (`judge` the
status and events, `publish` them: status written once if it changed). `act` and `publish` run in a
thread when they call the API server (the Kubernetes client is synchronous), on the loop otherwise;
the work queue (tandem.operator.controller) runs one pass at a time per service: no lock.

An idle pass costs no API call but the internal Secret's create-if-absent (the one child the
operator does not watch, since it never reads a Secret): its children come from the watch
(tandem.operator.watch), and when nothing watched changed since a pass found every child as it
renders them (`Memory.settled`), nothing is rendered again.

Level-triggered: running a pass twice changes nothing the second time. The spec is parsed once per
pass into the typed InferenceServiceSpec; one the operator cannot use (a CRD older than the
operator lets more through) applies nothing and says why in Ready.

Status holds state: the planner's desired replicas for an autoscaled role (see
tandem.operator.autoscaling.status). A pass starts from the watch's copy of the InferenceService
only when it is the very version the last pass read or wrote (the same resourceVersion), else from
a fresh read; the planner's decisions are made and kept inside passes, so no pass applies, or writes
back, a status older than the newest decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from kubernetes import client
from tandem.contracts.runtimes import DEFAULT_RUNTIME
from tandem.operator import api_client, router_parity
from tandem.operator.act import act, secret_due
from tandem.operator.autoscaling.autoscaler import Planning, autoscale
from tandem.operator.conclude import judge, parse_spec, publish
from tandem.operator.config import OperatorConfig
from tandem.operator.memory import Memory
from tandem.operator.metrics import OperatorMetrics
from tandem.operator.observe import Owners, learn_owners, missing_owners, observe
from tandem.operator.spec import WORKER_ROLES, InferenceServiceSpec
from tandem.operator.watch import Key, Seen, Watched
from tandem.operator.work import Trigger, Work
from tandem.planning.autoscaling.planner import Decision

log = logging.getLogger(__name__)


@dataclass
class ServiceState:
    """What the operator keeps per InferenceService between passes (dropped when it is deleted)."""

    generation: int | None = None  # the newest metadata.generation queued for applying
    memory: Memory = field(default_factory=Memory)
    planning: Planning = field(default_factory=Planning)


@dataclass
class PassContext:
    """What every pass shares: the API client, the operator's settings, the watch, one pool for pod
    answers, the metrics."""

    api: client.ApiClient
    config: OperatorConfig
    watched: Watched
    session: aiohttp.ClientSession
    metrics: OperatorMetrics


@dataclass(frozen=True)
class Outcome:
    """What a pass came to, for the controller's timers and metrics."""

    spec: InferenceServiceSpec | None
    spec_error: str | None
    result: api_client.ApplyResult

    @property
    def error(self) -> str | None:
        """The reason of an error the pass reported in status (ApplyFailed, AdoptionRefused,
        InvalidSpec, PolicyDenied), or None."""
        if not self.result.error:
            return None
        return "InvalidSpec" if self.spec_error else self.result.reason


async def run_pass(ctx: PassContext, key: Key, work: Work, state: ServiceState) -> Outcome | None:
    """Read, observe, (plan), act, observe, read the routers, conclude. None when the InferenceService is gone
    (or going: the garbage collector removes the children)."""
    memory = state.memory
    body = await read_service(ctx, key, memory)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    if state.generation is None:  # first seen through a child or a timer
        state.generation = body["metadata"].get("generation")
    spec, spec_error = parse_spec(body, memory)
    uid = body["metadata"].get("uid")
    groups = spec is None or any(spec.role(r).parallelism.spans_nodes for r in WORKER_ROLES)
    seen = ctx.watched.seen(key)
    await _complete_owners(ctx.api, key[0], seen, memory.owners)
    before = observe(seen, key[1], uid, memory.owners, groups)
    decision = None
    if work.plan and spec is not None:
        decision = await autoscale(state.planning, uid, spec, before, ctx.config, ctx.session)
        if decision is not None:
            ctx.metrics.decided(*key, decision, state.planning.snapshot)
    act_args = (ctx.api, body, ctx.config, work, memory, decision, before, seen)
    acted = act(*act_args) if _acts_offline(body, ctx.config, memory, decision, seen) else \
        await asyncio.to_thread(act, *act_args)
    obs = before
    if not acted.unchanged:  # what the apply returned is newer than what the watch has seen yet
        seen = seen.overlaid(acted.result.stored, gone=acted.result.pruned)
        obs = observe(seen, key[1], uid, memory.owners, groups)
    parity = await router_parity.read_routers(obs, ctx.config, ctx.session)
    # vLLM's servers have no KV health report (KVTransferReady NotApplicable): none is looked for
    tandem = spec is None or spec.runtime.name == DEFAULT_RUNTIME
    kv = router_parity.worker_health(obs, parity) if tandem else None
    concluded = judge(body, ctx.config, memory, acted, obs, decision, kv, parity, seen)
    # to a thread only when there is something to write (the client is synchronous): an idle pass
    # concludes on the loop (the hop was a fifth of its CPU at 1,000 services)
    memory.version = (await asyncio.to_thread(publish, ctx.api, body, concluded) if concluded.calls
                      else publish(ctx.api, body, concluded))
    if work.trigger is Trigger.SPEC:
        log.info("%s/%s: generation %s reconciled%s", *key, body["metadata"].get("generation"),
                 f" ({acted.result.error})" if acted.result.error else "")
    return Outcome(spec, spec_error, acted.result)


def _acts_offline(body: dict, config: OperatorConfig, memory: Memory, decision: Decision | None, seen: Seen) -> bool:
    """Whether `act` will call nothing, so it runs on the event loop rather than a thread (the hop
    was a good part of an idle pass): a pass with no decision to act on, whose service and children
    are as a pass found every child rendered (Memory.settled: the same resourceVersion, so the same
    status and model finding), with the internal Secret's check not due."""
    fingerprint = (body["metadata"].get("resourceVersion"), seen.fingerprint())
    return (decision is None and memory.settled == fingerprint
            and not secret_due(memory, config.resync_seconds, time.monotonic()))


async def read_service(ctx: PassContext, key: Key, memory: Memory) -> dict | None:
    """The InferenceService: the watch's copy when it is the version the last pass read or wrote (or
    the first this process sees), else read afresh (the watch may not have our own status write yet).
    A copy: the pass sets its status."""
    body = ctx.watched.service(key)
    if body is None or (memory.version is not None and body["metadata"].get("resourceVersion") != memory.version):
        body = await asyncio.to_thread(api_client.get_service, ctx.api, *key)
    return dict(body) if body is not None else None


async def _complete_owners(api: client.ApiClient, namespace: str, seen: Seen, owners: Owners) -> None:
    """The owner chain's controllers that neither the watch nor an earlier pass has seen, read once each."""
    learn_owners(seen, owners)
    for kind, name, uid in missing_owners(seen, owners):
        found = await asyncio.to_thread(api_client.read_controller, api, namespace, kind, name, uid)
        owners[uid] = next((r for r in (found or {}).get("metadata", {}).get("ownerReferences") or []
                            if r.get("controller")), None)
