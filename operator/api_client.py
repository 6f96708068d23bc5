"""The operator's client of the Kubernetes API: every call it makes outside kopf's watches, each
bounded and counted (`request`).

Every write of a child is a server-side apply (PATCH application/apply-patch+yaml, force) under
one field manager, so reconciling is idempotent and a no-op apply writes nothing. The one other
write to a child is the pod annotations that name the pods a scale-down removes (mark_for_removal).
What the operator observes comes from its watches (tandem.operator.watch), not from here: the only
reads left are a child's metadata before an apply that the watch cannot vouch for, the owner chain's
controllers the watch has not seen, and the InferenceService when the watch may lag the operator's
own status write.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field

from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.contracts.names import GROUP, PLURAL, VERSION
from tandem.operator.config import DEFAULT_API_TIMEOUT_SECONDS, FIELD_MANAGER, HANDOVER_MANAGER
from tandem.operator.metrics import METRICS

log = logging.getLogger(__name__)
# Every API call is bounded (connect, read): a hung API server must not wedge a reconcile.
API_TIMEOUT_S = float(os.environ.get("TANDEM_API_TIMEOUT_SECONDS") or DEFAULT_API_TIMEOUT_SECONDS)

# How often a call may refresh the client's credentials (see throttled_credentials).
CREDENTIALS_REFRESH_S = 10.0

# The ReplicaSet removes pods of the lowest cost first; CHOSEN says the planner picked the pod (and
# when), so a scale-down's pods are known before replicas drop (a step that moves their running
# sequences away first would start from these pods).
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
CHOSEN = "tandem.dev/chosen-for-removal"

# Kinds whose spec.replicas an external autoscaler may own (External mode).
SCALED_KINDS = ("Deployment", "LeaderWorkerSet")
# (apiVersion, kind) -> URL path template of the named object.
PATHS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "/api/v1/namespaces/{namespace}/configmaps/{name}",
    ("v1", "Service"): "/api/v1/namespaces/{namespace}/services/{name}",
    ("v1", "ServiceAccount"): "/api/v1/namespaces/{namespace}/serviceaccounts/{name}",
    ("v1", "PersistentVolumeClaim"): "/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}",
    ("batch/v1", "Job"): "/apis/batch/v1/namespaces/{namespace}/jobs/{name}",
    ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"):
        "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{namespace}/leaderworkersets/{name}",
    ("networking.k8s.io/v1", "NetworkPolicy"): "/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/{name}",
    ("rbac.authorization.k8s.io/v1", "Role"): "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/{name}",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings/{name}",
    ("policy/v1", "PodDisruptionBudget"): "/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}",
    ("inference.networking.k8s.io/v1", "InferencePool"):
        "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools/{name}",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "/apis/gateway.networking.k8s.io/v1/namespaces/{namespace}/httproutes/{name}",
}


@dataclass
class ApplyResult:
    """What one pass of applies did, for events and status."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    error: str | None = None
    retryable: bool = False
    reason: str = "ApplyFailed"  # Ready's reason when error is set (AdoptionRefused: ownership.py)
    stored: list[dict] = field(default_factory=list)  # what each apply returned: newer than the watch
    pruned: list[str] = field(default_factory=list)  # refs of the stale workloads deleted


def ref(manifest: dict) -> str:
    return f"{manifest['kind']}/{manifest['metadata']['name']}"


def _path(manifest: dict) -> str:
    meta = manifest["metadata"]
    template = PATHS[(manifest["apiVersion"], manifest["kind"])]
    return template.format(namespace=meta["namespace"], name=meta["name"])


def throttled_credentials(configuration: client.Configuration, every_s: float = CREDENTIALS_REFRESH_S) -> None:
    """Lets the client refresh its credentials at most every `every_s`, not before every call: the
    kubeconfig loader's hook re-sets the host on each call, which scans the environment for proxies
    (half a millisecond of CPU per call, most of an idle pass's); the in-cluster one only rereads the
    token once it is due, which a refresh every few seconds still catches in time."""
    if configuration.refresh_api_key_hook is None:
        return
    hook, last = [configuration.refresh_api_key_hook], [-math.inf]

    def refresh(config: client.Configuration) -> None:
        now = time.monotonic()
        if now - last[0] < every_s:
            return
        last[0] = now
        hook[0](config)
        if config.refresh_api_key_hook is not refresh:  # the kubeconfig loader sets its hook again
            hook[0], config.refresh_api_key_hook = config.refresh_api_key_hook, refresh

    configuration.refresh_api_key_hook = refresh


def request(
    api: client.ApiClient,
    method: str,
    path: str,
    query: list[tuple[str, str]] | None = None,
    body: dict | None = None,
    content_type: str | None = None,
    timeout_s: float | None = None,
    accept: str = "application/json",
) -> dict:
    """One raw API call returning the JSON body as a dict; non-2xx raises ApiException. `timeout_s`
    bounds it (default API_TIMEOUT_S)."""
    headers = {"Accept": accept}
    if content_type:
        headers["Content-Type"] = content_type
    params = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=query or [],
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    limit = API_TIMEOUT_S if timeout_s is None else timeout_s
    METRICS.api_requests.labels(method).inc()
    with METRICS.api_seconds.time():
        resp = api.call_api(*params, _request_timeout=(min(5.0, limit), limit))
    resp.read()
    text = (resp.data or b"").decode("utf-8", errors="replace")
    if not 200 <= resp.status <= 299:
        raise ApiException.from_response(http_resp=resp, body=text, data=None)
    return json.loads(text) if text else {}


def server_side_apply(api: client.ApiClient, manifest: dict) -> dict:
    """One SSA PATCH (force: the operator owns what it renders); returns the stored object."""
    return request(
        api,
        "PATCH",
        _path(manifest),
        query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
        body=manifest,
        content_type="application/apply-patch+yaml",
    )


# The object's metadata alone: what deciding whether (and how) to apply needs, a fraction of the bytes.
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


def read_object(api: client.ApiClient, manifest: dict, metadata_only: bool = False) -> dict | None:
    try:
        return request(api, "GET", _path(manifest), accept=METADATA_ONLY if metadata_only else "application/json")
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def owns_replicas(live: dict, manager: str = FIELD_MANAGER) -> bool:
    """Whether `manager`'s server-side applies own the Deployment's spec.replicas."""
    for entry in live["metadata"].get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
                return True
    return False


def release_replicas(api: client.ApiClient, manifest: dict, live: dict) -> None:
    """Hands spec.replicas of a live Deployment over before the operator applies it without the field.

    Server-side apply removes a field that its only owner stops applying, and the Deployment would
    fall back to 1 replica. So a second field manager first applies the current count (the two now
    co-own it); dropping the operator's claim then keeps the value, and the next writer (an HPA,
    KEDA, kubectl scale) takes the field over.
    """
    meta = manifest["metadata"]
    claim = {"apiVersion": manifest["apiVersion"], "kind": manifest["kind"],
             "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
             "spec": {"replicas": live["spec"].get("replicas", 1)}}
    request(api, "PATCH", _path(manifest), query=[("fieldManager", HANDOVER_MANAGER), ("force", "true")],
            body=claim, content_type="application/apply-patch+yaml")


def error_text(e: ApiException) -> str:
    try:
        return json.loads(e.body or "").get("message") or f"{e.status} {e.reason}"
    except (TypeError, ValueError, AttributeError):
        return f"{e.status} {e.reason}"


def missing_kind_hint(manifest: dict, e: ApiException) -> str:
    """What to do when the cluster does not serve a kind the spec needs (LeaderWorkerSet's CRD)."""
    if e.status == 404 and manifest["kind"] == "LeaderWorkerSet":
        return ("; the LeaderWorkerSet API (sigs.k8s.io/lws) is not installed in this cluster: install it "
                "to run groups that span nodes (parallelism.nodes > 1), see docs/parallelism.md")
    if e.status == 404 and manifest["kind"] in ("InferencePool", "HTTPRoute"):
        return (f"; the {manifest['kind']} API ({manifest['apiVersion']}) is not installed in this cluster: "
                "spec.gateway needs the Gateway API and its Inference Extension CRDs, which come with your "
                "gateway (Tandem's chart does not install them), see docs/gateway.md")
    return ""


def prune(api: client.ApiClient, owner_uid: str, stale: list[dict], seen: dict[str, dict]) -> list[str]:
    """Deletes the children a spec no longer renders (a role's Deployment once its groups span nodes,
    or its LeaderWorkerSet once they fit one node), when the InferenceService `owner_uid` controls
    them. `stale` holds their (apiVersion, kind, metadata) stubs, `seen` the watched children by
    ref (one not there is not the service's: the watch sees every labelled one); returns what was
    deleted."""
    deleted = []
    for stub in stale:
        owners = (seen.get(ref(stub)) or {}).get("metadata", {}).get("ownerReferences") or []
        if not any(o.get("controller") and o.get("uid") == owner_uid for o in owners):
            continue
        try:
            request(api, "DELETE", _path(stub), body={"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status != 404:
                raise
        deleted.append(ref(stub))
    return deleted


def read_controller(api: client.ApiClient, namespace: str, kind: str, name: str, uid: str) -> dict | None:
    """A ReplicaSet or StatefulSet of a pod's owner chain, None when it is gone or is another object
    of that name (its uid differs)."""
    plural = {"ReplicaSet": "replicasets", "StatefulSet": "statefulsets"}[kind]
    try:
        found = request(api, "GET", f"/apis/apps/v1/namespaces/{namespace}/{plural}/{name}", accept=METADATA_ONLY)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return found if found["metadata"].get("uid") == uid else None


def ensure_internal_secret(api: client.ApiClient, secret: dict) -> tuple[ApplyResult, str | None]:
    """Create the service's internal Secret unless it exists: (what happened, the new Secret's uid or
    None when it existed). Create-only: the operator never reads a Secret, so whether an existing one
    may be used is judged from status (ownership.secret_record), and its value never leaves the API
    server but into the pods that mount it."""
    meta = secret["metadata"]
    try:
        created = request(api, "POST", f"/api/v1/namespaces/{meta['namespace']}/secrets", body=secret)
    except ApiException as e:
        if e.status == 409:
            return ApplyResult(), None
        return ApplyResult(error=f"creating {ref(secret)}: {error_text(e)}",
                           retryable=e.status is None or e.status >= 500 or e.status == 429), None
    except Exception as e:  # connection errors and the like: retry later
        return ApplyResult(error=f"creating {ref(secret)}: {e}", retryable=True), None
    return ApplyResult(created=[ref(secret)]), created["metadata"]["uid"]


def mark_for_removal(api: client.ApiClient, namespace: str, pods: list[dict], chosen: tuple[str, ...],
                     stamp: str) -> list[str]:
    """Makes the ReplicaSet remove exactly the `chosen` pods (in that order) when replicas drop: the
    lowest pod-deletion-cost, and the CHOSEN annotation with the time. Pods marked before and not
    chosen now lose both. Returns what could not be patched (a pod gone meanwhile is no error)."""
    patches = {name: {DELETION_COST: str(i - 1000), CHOSEN: stamp} for i, name in enumerate(chosen)}
    for pod in pods:
        name = pod["metadata"]["name"]
        if name not in patches and CHOSEN in (pod["metadata"].get("annotations") or {}):
            patches[name] = {DELETION_COST: None, CHOSEN: None}
    errors = []
    for name, marks in patches.items():
        try:
            request(api, "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}",
                    body={"metadata": {"annotations": marks}}, content_type="application/merge-patch+json")
        except ApiException as e:
            if e.status != 404:
                errors.append(f"pod {name}: {error_text(e)}")
        except Exception as e:  # connection errors and the like
            errors.append(f"pod {name}: {e}")
    return errors


def _cr_path(namespace: str | None, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}"
    path = f"{base}/namespaces/{namespace}/{PLURAL}" if namespace else f"{base}/{PLURAL}"
    return f"{path}/{name}" if name else path


def get_service(api: client.ApiClient, namespace: str, name: str) -> dict | None:
    """The InferenceService as a dict, or None when it is gone."""
    try:
        return request(api, "GET", _cr_path(namespace, name))
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def write_status(
    api: client.ApiClient, namespace: str, name: str, status: dict, old: dict | None = None
) -> str | None:
    """Merge-patches the status subresource to `status` (lists are replaced whole; keys of `old`
    that `status` lacks are removed, e.g. the endpoint once the router Service is gone). Returns the
    InferenceService's resourceVersion after the write (None when it is gone)."""
    patch: dict = {key: None for key in (old or {}) if key not in status} | status
    try:
        written = request(
            api,
            "PATCH",
            _cr_path(namespace, name) + "/status",
            body={"status": patch},
            content_type="application/merge-patch+json",
        )
    except ApiException as e:
        if e.status != 404:  # deleted meanwhile: nothing to report on
            raise
        return None
    return written["metadata"].get("resourceVersion")


def post_event(api: client.ApiClient, body: dict, type_: str, reason: str, message: str) -> None:
    """A core/v1 Event on the InferenceService; failing to post one never fails a reconcile."""
    meta = body["metadata"]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": body.get("apiVersion", f"{GROUP}/{VERSION}"),
            "kind": body.get("kind", "InferenceService"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": FIELD_MANAGER},
        "reportingComponent": FIELD_MANAGER,
        "reportingInstance": socket.gethostname(),
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    try:
        request(api, "POST", f"/api/v1/namespaces/{meta['namespace']}/events", body=event)
    except Exception as e:  # events are best effort
        log.warning("could not post event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], e)
