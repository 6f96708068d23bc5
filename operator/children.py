"""Applying one InferenceService's children: every child's metadata read at once, the children applied
in two rounds (what pods need, then what runs pods), each round at once, and a child nobody changed
since the same manifest was applied left alone. What one child's apply is (server-side apply, the
refusal of what another owner holds, the hand-over of replicas) is tandem.operator.api_client's.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.operator.api_client import (
    SCALED_KINDS,
    ApplyResult,
    error_text,
    missing_kind_hint,
    owns_replicas,
    read_object,
    ref,
    release_replicas,
    server_side_apply,
)
from tandem.operator.ownership import REFUSED, refusal


@dataclass(frozen=True)
class Applied:
    """What a child was last applied as, and the object the apply returned: an unchanged manifest
    over an unchanged object needs no apply (an idle pass applies nothing)."""

    digest: str
    resource_version: str
    generation: int | None = None
    labels: tuple[tuple[str, str], ...] = ()  # the labels the manifest set


def _digest(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


def _same(live: dict, last: Applied, labels: dict) -> bool:
    """Whether `live` is what the apply recorded in `last` left: the same resourceVersion, or for an
    object with a spec generation (a workload, a Job, a PodDisruptionBudget: their controllers keep
    writing status), the same generation and `labels`."""
    meta = live["metadata"]
    if meta.get("resourceVersion") == last.resource_version:
        return True
    if meta.get("generation") is None or meta.get("generation") != last.generation:
        return False
    have = meta.get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def _untouched(live: dict, manifest: dict, last: Applied | None, digest: str) -> bool:
    """Whether `live` is still what applying this very manifest left."""
    if last is None or last.digest != digest:
        return False
    return _same(live, last, manifest["metadata"].get("labels") or {})


def drifted(live: dict, last: Applied) -> bool:
    """Whether someone else changed `live` since the operator applied it (its watch event says)."""
    return not _same(live, last, dict(last.labels))


_READS: ThreadPoolExecutor | None = None
READ_THREADS = 32  # each may hold an API connection at once (the client's pool is sized for them)


def _reader() -> ThreadPoolExecutor:
    """The threads that read and apply a pass's children at once (a process-wide pool: passes run in
    threads; a task here never waits on another task here)."""
    global _READS
    if _READS is None:
        _READS = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="read")
    return _READS


# Applied after everything else has been: what runs pods (their ConfigMap, Secret and RBAC first), and
# the gateway's kinds (spec.gateway), whose CRDs may be missing: that refusal leaves the rest applied.
LAST_KINDS = (*SCALED_KINDS, "Job", "InferencePool", "HTTPRoute")


@dataclass
class _Outcome:
    change: str | None = None  # "created" | "updated" | None (left as it was)
    error: str | None = None
    retryable: bool = False
    reason: str = "ApplyFailed"
    stored: dict | None = None  # what the apply returned


def _apply_one(api: client.ApiClient, manifest: dict, live: dict | None, applied: dict[str, Applied]) -> _Outcome:
    """One child: refused when another owner holds it, left alone when nobody changed it, else applied."""
    digest = _digest(manifest)
    try:
        refused = refusal(live, manifest) if live is not None else None
        if refused is not None:
            return _Outcome(error=refused.message, retryable=refused.retryable, reason=REFUSED)
        if live is not None and _untouched(live, manifest, applied.get(ref(manifest)), digest):
            return _Outcome()
        if (live is not None and manifest["kind"] in SCALED_KINDS and "replicas" not in manifest["spec"]
                and owns_replicas(live)):
            release_replicas(api, manifest, live if "spec" in live else read_object(api, manifest) or live)
        before = live["metadata"]["resourceVersion"] if live is not None else None
        obj = server_side_apply(api, manifest)
        stored = obj["metadata"]
        labels = tuple(sorted((manifest["metadata"].get("labels") or {}).items()))
        applied[ref(manifest)] = Applied(digest, stored["resourceVersion"], stored.get("generation"), labels)
    except ApiException as e:
        # 4xx other than conflicts/throttling: the API server refuses what we rendered.
        return _Outcome(error=f"applying {ref(manifest)}: {error_text(e)}{missing_kind_hint(manifest, e)}",
                        retryable=e.status is None or e.status >= 500 or e.status in (409, 429))
    except Exception as e:  # connection errors and the like: retry later
        return _Outcome(error=f"applying {ref(manifest)}: {e}", retryable=True)
    if before is None:
        return _Outcome("created", stored=obj)
    return _Outcome("updated" if before != stored["resourceVersion"] else None, stored=obj)


def _vouched(manifest: dict, known: dict[str, dict], applied: dict[str, Applied]) -> bool:
    """Whether the watched object can stand for a read: nothing was applied over it by this process
    yet (the watch then holds what the last listing or event said), or it is what the last apply
    left. Otherwise it may be drift, or the watch may not have caught up with that apply: read it."""
    live = known.get(ref(manifest))
    if live is None:
        return False  # not seen: absent, or not labelled as ours (another owner's): read it
    last = applied.get(ref(manifest))
    return last is None or not drifted(live, last)


def _read_all(api: client.ApiClient, manifests: list[dict], known: dict[str, dict],
              applied: dict[str, Applied]) -> list[dict | _Outcome | None]:
    """Each child's metadata, from the watch where it vouches for it, else read, all at once (a pass
    waits one round trip), or why it could not be read."""
    reads = [None if _vouched(m, known, applied) else _reader().submit(read_object, api, m, True)
             for m in manifests]
    out: list[dict | _Outcome | None] = []
    for manifest, read in zip(manifests, reads, strict=True):
        try:
            out.append(known.get(ref(manifest)) if read is None else read.result())
        except ApiException as e:
            out.append(_Outcome(error=f"reading {ref(manifest)}: {error_text(e)}",
                                retryable=e.status is None or e.status >= 500 or e.status == 429))
        except Exception as e:  # connection errors and the like
            out.append(_Outcome(error=f"reading {ref(manifest)}: {e}", retryable=True))
    return out


def apply_all(api: client.ApiClient, manifests: list[dict], applied: dict[str, Applied] | None = None,
              known: dict[str, dict] | None = None) -> ApplyResult:
    """Applies children, those that run pods last; stops at the first failure and says whether
    retrying may help.

    A GET of each child's metadata before its apply tells created/updated/unchanged apart (a no-op
    apply keeps the resourceVersion), which is what the events on the CR report, and whose an
    existing object is: one the InferenceService does not control is refused, not taken over
    (ownership.refusal). With `applied` (kept per service) a child nobody changed since the same
    manifest was applied is not applied again; `known` holds the watched children (by ref): one the
    watch vouches for is not read.
    The reads go at once, then the applies in two rounds (the children pods need, then the
    workloads), each round at once: a pass waits three round trips, not one per child.
    """
    result, applied = ApplyResult(), {} if applied is None else applied
    lives = _read_all(api, manifests, known or {}, applied)
    first = [i for i, m in enumerate(manifests) if m["kind"] not in LAST_KINDS]
    for stage in (first, [i for i in range(len(manifests)) if i not in first]):
        outcomes = {i: lives[i] for i in stage if isinstance(lives[i], _Outcome)}
        pending = {i: _reader().submit(_apply_one, api, manifests[i], lives[i], applied)
                   for i in stage if i not in outcomes}
        outcomes |= {i: f.result() for i, f in pending.items()}
        for i in stage:  # in manifest order: the first failure is the one reported
            out = outcomes[i]
            if out.stored is not None:
                result.stored.append(out.stored)
            if out.error:
                return ApplyResult(result.created, result.updated, out.error, out.retryable, out.reason,
                                   result.stored)
            if out.change:
                getattr(result, out.change).append(ref(manifests[i]))
    return result
