"""The router's handoff parity checker: probes each new pairing as it becomes ready, keeps every
worker's verdict for the routing policy, and reports them (GET /internal/parity, for the operator's
HandoffVerified condition; Prometheus).

Every poll of the workers (workers.py) hands the checker the router's view of them; one probe runs at
a time (router/parity/probe.py), the next chosen by router/parity/decisions.py: new workers first, then retries
after a probe that could not finish (backing off), a worker found MISMATCH beside an unproven partner
once a VERIFIED one is there, then rechecks every `recheck_s`. At start-up the
router waits (briefly) until the ready pairings are proven, so its first requests are handed off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tandem.contracts.handoff_parity import (
    PARITY_PATH,
    RECHECK_S,
    ParityReport,
    ParityState,
    ProbeOutcome,
    ProbeResult,
)
from tandem.router.parity.decisions import Pair, ParityTable, tolerance_for
from tandem.router.parity.probe import run_probe
from tandem.router.policies.base import WorkerView
from tandem.router.worker_client import WorkerClient
from tandem.router.workers import WorkerSet

log = logging.getLogger("tandem.router.parity")


class ParityMetrics:
    """tandem_router_parity_*: probes by outcome, their duration, the last measured difference, and
    workers by standing (no per-worker label: the report at /internal/parity names them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.probes = Counter("tandem_router_parity_probes_total",
                              "Handoff parity probes, by outcome (match, mismatch, error)", ["outcome"],
                              registry=registry)
        self.seconds = Histogram("tandem_router_parity_probe_seconds", "Duration of one handoff parity probe",
                                 registry=registry, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.diff = Gauge("tandem_router_parity_last_max_abs_logprob_diff",
                          "The last completed probe's largest |logprob difference| between handoff and alone",
                          registry=registry)
        self.workers = Gauge("tandem_router_parity_workers",
                             "Workers by handoff parity standing (only verified ones take part in handoffs)",
                             ["state"], registry=registry)
        for outcome in ProbeOutcome:
            self.probes.labels(outcome.value)


class ParityChecker:
    """Runs the probes and holds the verdicts (see the module docstring)."""

    def __init__(self, client: WorkerClient, registry: CollectorRegistry, tolerance: float | None = None,
                 recheck_s: float = RECHECK_S, timeout_s: float = 30.0) -> None:
        self.client = client
        self.table = ParityTable(recheck_s=recheck_s)
        self.metrics = ParityMetrics(registry)
        self.tolerance = tolerance  # None: by the workers' dtype
        self.timeout_s = timeout_s
        self._views: list[WorkerView] = []
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()  # set after every probe, for settle()
        self._task: asyncio.Task | None = None

    # --- what the router asks --------------------------------------------------------------------

    def state(self, url: str) -> ParityState:
        return self.table.state(url)

    def report(self) -> ParityReport:
        return self.table.report(enabled=True)

    def on_poll(self, views: Sequence[WorkerView]) -> None:
        """WorkerSet's listener: the workers as just polled."""
        self._views = list(views)
        self.table.update(self._views)
        self._count()
        self._wake.set()

    def attach(self, workers: WorkerSet) -> None:
        """Follow `workers`' polls, give its views each worker's standing, and start probing."""
        workers.listeners.append(self.on_poll)
        workers.parity = self.state
        self._task = asyncio.get_running_loop().create_task(self._run(), name="parity-checker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def settle(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until no ready pairing waits for its first probe; True if none does."""
        deadline = time.monotonic() + timeout_s
        while not self.table.settled(self._views, time.monotonic()):
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), deadline - time.monotonic())
            except TimeoutError:
                return False
        return True

    # --- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._wake.clear()  # before choosing: a poll from now on wakes the sleep below
            pair = self.table.next_pair(self._views, time.monotonic())
            if pair is None:
                await self._sleep()
                continue
            self.table.begin(pair)
            try:
                result = await self._probe(pair)
            except Exception:  # a bug here must not end the checker: the pair counts as failed
                log.exception("handoff parity probe of %s -> %s raised", pair.prefill.url, pair.decode.url)
                result = ProbeResult(pair.prefill.url, pair.decode.url, pair.decode.kv_compat, ProbeOutcome.ERROR,
                                     message="the probe raised (see the router's log)", at_unix=time.time())
            self.table.finish(pair, result, time.monotonic())
            self._count()
            self._progress.set()

    async def _sleep(self) -> None:
        """Until the next poll, or until a retry or recheck falls due."""
        now = time.monotonic()
        due = self.table.next_due(now)
        wait = None if due is None else max(0.0, due - now)
        try:
            await asyncio.wait_for(self._wake.wait(), wait)
        except TimeoutError:
            pass

    async def _probe(self, pair: Pair) -> ProbeResult:
        """One probe, and a second one when the first disagrees: a batch shared with other requests
        can, rarely, push a good pairing past the tolerance once (bfloat16), a fault does it again."""
        tolerance = tolerance_for(pair.decode.dtype or pair.prefill.dtype, self.tolerance)
        result = await self._measured(pair, tolerance)
        if result.outcome is ProbeOutcome.MISMATCH:
            first = result
            result = await self._measured(pair, tolerance)
            if result.outcome is not ProbeOutcome.MISMATCH:
                log.warning("handoff parity: prefill %s -> decode %s disagreed once (%s) but not again: taken "
                            "as noise", pair.prefill.url, pair.decode.url, first.message)
            else:
                result.message += f"; confirmed by a second probe ({first.max_abs_diff:.3g} the first time)"
        level = logging.INFO if result.outcome is ProbeOutcome.MATCH else logging.WARNING
        what = {ProbeOutcome.MATCH: "agree", ProbeOutcome.MISMATCH: "DISAGREE: no KV handoff between them",
                ProbeOutcome.ERROR: "could not be compared"}[result.outcome]
        log.log(level, "handoff parity: prefill %s -> decode %s (kv_compat %s) %s: %s (%.2f s)",
                pair.prefill.url, pair.decode.url, pair.decode.kv_compat or "-", what, result.message,
                result.seconds)
        return result

    async def _measured(self, pair: Pair, tolerance: float) -> ProbeResult:
        result = await run_probe(self.client, pair, tolerance, self.timeout_s)
        self.metrics.probes.labels(result.outcome.value).inc()
        self.metrics.seconds.observe(result.seconds)
        if result.max_abs_diff is not None:
            self.metrics.diff.set(result.max_abs_diff)
        return result

    def _count(self) -> None:
        for state, n in self.table.counts().items():
            self.metrics.workers.labels(state.value).set(n)


def add_routes(app: web.Application, router: Any) -> None:
    """GET /internal/parity: every worker's standing and KV health (a ParityReport). Open, like
    /metrics: the operator reads it for HandoffVerified and KVTransferReady without the service's
    secrets; it names workers, no data."""

    async def report(request: web.Request) -> web.Response:
        checker: ParityChecker | None = router.parity
        doc = checker.report() if checker is not None else ParityReport(enabled=False)
        if router.workers is not None:
            doc.kv_health, doc.unreachable = router.workers.kv_health()
        return web.json_response(doc.to_dict())

    app.router.add_get(PARITY_PATH, report)
