"""Leader election between operator replicas: acquire, renew, release one Lease (the I/O; what to
write, and until when this replica leads, is decided in tandem.operator.election).

`tandem operator --leader-election` waits as a standby (serving its liveness endpoint, doing
nothing else) until it holds the Lease, then runs kopf and renews the Lease every retry period.
A leader stops leading at the renew deadline after the start of its last successful renewal: a
watchdog on the event loop fires then, whatever the renewal in flight is doing (a slow API server),
and the process exits at once (the kubelet restarts it as a standby), before a candidate may take
the Lease (the lease duration, longer than the deadline, counted from the last renewal it saw). A
renewal that fails, however it fails (an ApiException, a refused connection's MaxRetryError, a
timeout), is only a failed renewal: the next one may still succeed before the deadline. A leader
stopping on SIGTERM releases the Lease, so the standby takes over within one retry period instead of
a lease duration.

The election has an API client of its own with urllib3's retries turned off (a retried call could
outlast the deadline several times over), and every call is bounded by the time its attempt has
left. kubernetes.leaderelection exists, but it runs threads with blocking sleeps, never releases the
Lease on shutdown and exits the process on a bad setting: this is the same algorithm on the event loop.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
import os
import socket
import time
import uuid

from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.operator.api_client import request
from tandem.operator.election import (
    ElectionConfig,
    Record,
    Renewal,
    Verdict,
    attempt_until,
    call_timeout,
    claim,
    judge,
    leading_until,
    release,
    renewal,
)

log = logging.getLogger(__name__)


class LeadershipLost(RuntimeError):
    """The Lease could not be renewed within the renew deadline (or someone else holds it now)."""


def identity() -> str:
    """Unique per process: the pod's name (or the host's) and a random suffix."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def election_client(api: client.ApiClient) -> client.ApiClient:
    """`api`'s server and credentials in a client of the election's own, whose calls are never
    retried: the caller bounds each call and decides what a failure means."""
    config = copy.deepcopy(api.configuration)
    config.retries = False
    return client.ApiClient(config)


def _why(e: BaseException) -> str:
    """An exception in a log line: ApiException's reason, else its type and message."""
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"


class LeaderElector:
    """One candidate for one Lease."""

    def __init__(self, api: client.ApiClient, config: ElectionConfig, me: str | None = None) -> None:
        self.api, self.config, self.me = election_client(api), config, me or identity()
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{config.namespace}/leases/{config.name}"
        self.record: Record | None = None
        self.changed_at = time.monotonic()
        self.renewed_at = 0.0  # monotonic time the last successful write was sent
        self.leading = False

    def _timeout(self, until: float | None) -> float:
        if until is None:
            return self.config.retry_s
        limit = call_timeout(time.monotonic(), until)
        if limit is None:
            raise TimeoutError("no time left for another call to the API server")
        return limit

    def _read(self, until: float | None = None) -> Record | None:
        try:
            lease = request(self.api, "GET", self.path, timeout_s=self._timeout(until))
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return Record.of(lease)

    def _write(self, method: str, spec: dict, resource_version: str | None, until: float | None = None) -> bool:
        """Create (POST) or replace (PUT, at the resourceVersion read): False when another won."""
        meta = {"name": self.config.name, "namespace": self.config.namespace}
        if resource_version:
            meta["resourceVersion"] = resource_version
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}
        path = self.path.rsplit("/", 1)[0] if method == "POST" else self.path
        try:
            written = request(self.api, method, path, body=body, timeout_s=self._timeout(until))
        except ApiException as e:
            if e.status == 409:  # a write in between (or a create at once): this candidate lost the race
                return False
            raise
        self.record = Record.of(written)
        self.changed_at = time.monotonic()
        return True

    def try_once(self, until: float | None = None) -> bool:
        """One look at the Lease, and the write it calls for, each call over by `until` (monotonic;
        None: each within the retry period): whether this candidate holds it now."""
        record = self._read(until)
        if record is None or self.record is None or record.seen != self.record.seen:
            self.changed_at = time.monotonic()
        self.record = record
        verdict = judge(record, self.me, self.changed_at, time.monotonic())
        if verdict is Verdict.WAIT:
            return False
        spec = claim(record, self.me, self.config.duration_s, verdict, datetime.datetime.now(datetime.UTC))
        if verdict is Verdict.CREATE:
            return self._write("POST", spec, None, until)
        return self._write("PUT", spec, record.resource_version if record else None, until)

    async def _attempt(self, until: float) -> bool | None:
        """try_once off the event loop; None when it raised (logged), whatever it raised."""
        try:
            return await asyncio.to_thread(self.try_once, until)
        except Exception as e:
            what = "renewing" if self.leading else "reading"
            log.warning("leader election: %s Lease %s failed: %s", what, self.config.name, _why(e))
            return None

    async def acquire(self) -> None:
        """Returns once this candidate holds the Lease (a standby waits here)."""
        log.info("leader election: %s waits for Lease %s/%s", self.me, self.config.namespace, self.config.name)
        while True:
            started = time.monotonic()
            if await self._attempt(started + self.config.retry_s):
                break
            await asyncio.sleep(max(0.0, started + self.config.retry_s - time.monotonic()))
        self.renewed_at = started
        self.leading = True
        log.info("leader election: %s leads (Lease %s/%s)", self.me, self.config.namespace, self.config.name)

    async def keep(self) -> None:
        """Renews the Lease every retry period; raises LeadershipLost once another candidate holds it,
        or at the renew deadline after the last successful renewal, even with a call in flight."""
        renewing = asyncio.create_task(self._renew(), name="lease-renewal")
        try:
            while not renewing.done():
                deadline = leading_until(self.renewed_at, self.config)
                await asyncio.wait({renewing}, timeout=max(0.0, deadline - time.monotonic()))
                if not renewing.done() and time.monotonic() >= leading_until(self.renewed_at, self.config):
                    self.leading = False
                    raise LeadershipLost(f"Lease {self.config.name} not renewed for "
                                         f"{self.config.renew_deadline_s:g} s")
            renewing.result()
        finally:
            renewing.cancel()

    async def _renew(self) -> None:
        """One renewal attempt every retry period, each over by the next one or the deadline."""
        started = self.renewed_at
        while True:
            await asyncio.sleep(max(0.0, started + self.config.retry_s - time.monotonic()))
            started = time.monotonic()
            held = await self._attempt(attempt_until(started, self.renewed_at, self.config))
            outcome = renewal(held, self.record.holder if self.record else None, self.me)
            if outcome is Renewal.RENEWED:
                self.renewed_at = max(self.renewed_at, started)
            elif outcome is Renewal.TAKEN:
                self.leading = False
                raise LeadershipLost(f"{self.record.holder} holds Lease {self.config.name} now")

    async def release(self) -> None:
        """Gives the Lease up (on a clean stop), so a standby takes it at once."""
        if not self.leading or self.record is None or self.record.holder != self.me:
            return
        self.leading = False
        spec = release(self.record, datetime.datetime.now(datetime.UTC))
        try:
            await asyncio.to_thread(self._write, "PUT", spec, self.record.resource_version)
            log.info("leader election: %s released Lease %s", self.me, self.config.name)
        except Exception as e:  # it expires by itself
            log.warning("leader election: releasing Lease %s failed: %s", self.config.name, _why(e))
