"""Waiting for Kubernetes Events in tests: kopf posts them from a background queue, so an Event
arrives after the status change it accompanies. Wait for it; never read it once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client
from tandem.testing.cluster import wait_until


def events_of(api: Any, namespace: str, name: str, kind: str | None = None) -> list[Any]:
    """The Events about the object `name` (of `kind`, if given) in namespace."""
    selector = f"involvedObject.name={name}" + (f",involvedObject.kind={kind}" if kind else "")
    return client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=selector).items


def wait_events(api: Any, namespace: str, name: str, match: Callable[[Any], bool], what: str,
                kind: str | None = None, timeout: float = 30) -> list[Any]:
    """The matching Events about `name`, once there is at least one."""
    return wait_until(lambda: [e for e in events_of(api, namespace, name, kind) if match(e)] or None,
                      timeout=timeout, what=what, interval=0.2)
