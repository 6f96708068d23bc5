"""Leader election between operator replicas: acquire, renew, release one Lease (the I/O; what to
write is decided in tandem.operator.lease).

`tandem operator --leader-election` waits as a standby (serving its liveness endpoint, doing
nothing else) until it holds the Lease, then runs kopf and renews the Lease every retry period.
A leader that cannot renew within the renew deadline has lost: it exits at once (the kubelet
restarts it as a standby), before a candidate may take the Lease (the lease duration, longer than
the deadline, counted from the last renewal it saw). A leader stopping on SIGTERM releases the Lease,
so the standby takes over within one retry period instead of a lease duration.

Every call is bounded by the retry period, so one hung request cannot outlast the renew deadline.
kubernetes.leaderelection exists, but it runs threads with blocking sleeps, never releases the Lease
on shutdown and exits the process on a bad setting: this is the same algorithm on the event loop.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import time
import uuid

from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.operator.apply import request
from tandem.operator.lease import ElectionConfig, Record, Verdict, claim, judge, release

log = logging.getLogger(__name__)


class LeadershipLost(RuntimeError):
    """The Lease could not be renewed within the renew deadline (or someone else holds it now)."""


def identity() -> str:
    """Unique per process: the pod's name (or the host's) and a random suffix."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class LeaderElector:
    """One candidate for one Lease."""

    def __init__(self, api: client.ApiClient, config: ElectionConfig, me: str | None = None) -> None:
        self.api, self.config, self.me = api, config, me or identity()
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{config.namespace}/leases/{config.name}"
        self.record: Record | None = None
        self.changed_at = time.monotonic()
        self.leading = False

    def _read(self) -> Record | None:
        try:
            lease = request(self.api, "GET", self.path, timeout_s=self.config.retry_s)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return Record.of(lease)

    def _write(self, method: str, spec: dict, resource_version: str | None) -> bool:
        """Create (POST) or replace (PUT, at the resourceVersion read): False when another won."""
        meta = {"name": self.config.name, "namespace": self.config.namespace}
        if resource_version:
            meta["resourceVersion"] = resource_version
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}
        path = self.path.rsplit("/", 1)[0] if method == "POST" else self.path
        try:
            written = request(self.api, method, path, body=body, timeout_s=self.config.retry_s)
        except ApiException as e:
            if e.status == 409:  # a write in between (or a create at once): this candidate lost the race
                return False
            raise
        self.record = Record.of(written)
        self.changed_at = time.monotonic()
        return True

    def try_once(self) -> bool:
        """One look at the Lease, and the write it calls for: whether this candidate holds it now."""
        record = self._read()
        if record is None or self.record is None or record.seen != self.record.seen:
            self.changed_at = time.monotonic()
        self.record = record
        verdict = judge(record, self.me, self.changed_at, time.monotonic())
        if verdict is Verdict.WAIT:
            return False
        spec = claim(record, self.me, self.config.duration_s, verdict, datetime.datetime.now(datetime.UTC))
        if verdict is Verdict.CREATE:
            return self._write("POST", spec, None)
        return self._write("PUT", spec, record.resource_version if record else None)

    async def acquire(self) -> None:
        """Returns once this candidate holds the Lease (a standby waits here)."""
        log.info("leader election: %s waits for Lease %s/%s", self.me, self.config.namespace, self.config.name)
        while True:
            try:
                if await asyncio.to_thread(self.try_once):
                    break
            except Exception as e:  # the API server unreachable: a standby keeps trying
                log.warning("leader election: reading Lease %s failed: %s", self.config.name, e)
            await asyncio.sleep(self.config.retry_s)
        self.leading = True
        log.info("leader election: %s leads (Lease %s/%s)", self.me, self.config.namespace, self.config.name)

    async def keep(self) -> None:
        """Renews the Lease every retry period; raises LeadershipLost when it cannot for the renew deadline."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.config.retry_s)
            try:
                if await asyncio.to_thread(self.try_once):
                    last = time.monotonic()
                    continue
                if self.record is not None and self.record.holder not in (None, self.me):
                    raise LeadershipLost(f"{self.record.holder} holds Lease {self.config.name} now")
            except ApiException as e:
                log.warning("leader election: renewing Lease %s failed: %s", self.config.name, e.reason)
            except (OSError, TimeoutError) as e:
                log.warning("leader election: renewing Lease %s failed: %s", self.config.name, e)
            if time.monotonic() - last > self.config.renew_deadline_s:
                self.leading = False
                raise LeadershipLost(f"Lease {self.config.name} not renewed for "
                                     f"{self.config.renew_deadline_s:g} s")

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
            log.warning("leader election: releasing Lease %s failed: %s", self.config.name, e)
