"""A pass's second half: `judge` (no I/O) finds the status from the observed children and the events
that report a change of state (a Warning once per transition, not per pass); `publish` writes the
status if it changed and posts the events. tandem.operator.reconcile calls both after
tandem.operator.act, `publish` in a thread only when it has something to send; `conclude` is the two.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from typing import TYPE_CHECKING

from kubernetes import client
from tandem.operator import api_client, model_check, policy
from tandem.operator.autoscaling.status import scaling_status
from tandem.operator.config import OperatorConfig
from tandem.operator.handoff_condition import RouterParity
from tandem.operator.memory import Memory
from tandem.operator.observe import download
from tandem.operator.ownership import REFUSED
from tandem.operator.render import endpoint, kv_compat_hash
from tandem.operator.render.weights import download_job_name
from tandem.operator.spec import WORKER_ROLES, InferenceServiceSpec, SpecError
from tandem.operator.status import KVProbe, Observation, compute_status, same_status
from tandem.operator.watch import Seen
from tandem.planning.autoscaling.planner import Decision

if TYPE_CHECKING:
    from tandem.operator.act import Acted

log = logging.getLogger(__name__)

# Condition reasons that earn a Warning event, once per transition into them. (A model refusal that
# applies nothing posts its own, once per message: act._model_event.)
WARNINGS = {"KVTransferReady": ("RDMAFallback", "TransferFailing", "BandwidthBelowFloor"),
            "HandoffVerified": ("ParityMismatch",),
            model_check.TYPE: ("DownloadFailed", "ClaimNotFound", "ClaimSingleNode")}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_spec(body: dict, memory: Memory | None = None) -> tuple[InferenceServiceSpec | None, str | None]:
    """(the typed spec, None), or (None, why the operator cannot use it); with `memory`, parsed once
    for each spec as stored."""
    stored = _spec_key(body)
    if memory is not None and memory.parsed is not None and memory.parsed[0] == stored:
        return memory.parsed[1], memory.parsed[2]
    try:
        parsed: tuple[InferenceServiceSpec | None, str | None] = InferenceServiceSpec.from_dict(body.get("spec")), None
    except SpecError as e:
        parsed = None, str(e)
    if memory is not None:
        memory.parsed = (stored, *parsed)
    return parsed


def _spec_key(body: dict) -> str:
    """What names the spec as stored: its uid and generation (the API server moves metadata.generation
    on every change of spec), or the spec itself where a body has neither (one made by hand). Keying
    by the generation spares an idle pass serializing the spec twice (a tenth of its CPU)."""
    meta = body.get("metadata") or {}
    if meta.get("uid") and meta.get("generation") is not None:
        return f"{meta['uid']}/{meta['generation']}"
    return json.dumps(body.get("spec"), sort_keys=True, separators=(",", ":"))


def condition_of(status: dict | None, type_: str) -> dict:
    conditions = (status or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), {})


def _warning_events(body: dict, new_status: dict, memory: Memory) -> list[Event]:
    """A Warning when KV transfer or a handoff's parity turns bad (not on every pass while it stays bad)."""
    events = []
    for type_, reasons in WARNINGS.items():
        old, new = condition_of(body.get("status"), type_), condition_of(new_status, type_)
        seen, memory.warned[type_] = memory.warned.get(type_), new.get("reason", "")
        if new.get("reason") in reasons and new.get("reason") not in (old.get("reason"), seen):
            events.append(("Warning", new["reason"], new["message"]))
    return events


def _status(body: dict, spec: InferenceServiceSpec | None, config: OperatorConfig, generation: int | None,
            obs: Observation, decision: Decision | None = None, model: model_check.ModelFinding | None = None,
            **findings: object) -> dict:
    """Status from the observed children; `findings` are Observation fields (apply_error, spec_error,
    kv_probes) that the caller knows and the API server does not; `decision` is the planner's, when
    one was just made; `model` what model_check found."""
    meta = body["metadata"]
    obs = dataclasses.replace(obs, **findings)
    old = body.get("status") or {}
    if generation is None:
        generation = old.get("observedGeneration")
    if model is not None:
        spec = model.spec  # a hub model pinned to its commit: the kv_compat the pods carry
    if spec is None:  # what runs came from an earlier spec: keep what status said of it
        url, kv_compat = old.get("endpoint"), old.get("kvCompat")
    elif (model is not None and model.blocking) or findings.get("apply_reason") == policy.DENIED:
        # nothing of this spec was applied: the pods are older
        url, kv_compat = endpoint(meta["name"], meta["namespace"], spec), old.get("kvCompat")
    else:
        url, kv_compat = endpoint(meta["name"], meta["namespace"], spec), kv_compat_hash(spec, config)
    stamp = now()
    scaling = scaling_status(spec, obs, old, stamp, decision)
    found = (model.status, model.condition) if model is not None else None
    return compute_status(spec, obs, old, stamp, generation, url, kv_compat, scaling, found)


def _model_finding(acted: Acted, service: str, obs: Observation, seen: Seen) -> model_check.ModelFinding | None:
    """The model's finding with how its downloads fare: the pinned commit's download Job, or the worker
    pods' own download init containers."""
    model = acted.model
    if model is not None and model_check.downloads(model):
        job, job_pods = download(seen, download_job_name(service, model.spec.model))
        return model_check.with_download(model, service, job, job_pods)
    if model is not None:  # a hostPath or emptyDir cache: each worker pod downloads for itself
        roles = [obs.roles[r] for r in WORKER_ROLES if r in obs.roles]
        return model_check.with_pod_downloads(model, [p for r in roles for p in r.pods + r.followers])
    return None


Event = tuple[str, str, str]  # type, reason, message


@dataclasses.dataclass
class Concluded:
    """What a pass concludes: the status, whether it must be written, and the events to post (in
    order). `calls` is False when publishing it asks the API server nothing (an idle pass), so the
    caller need not leave the event loop for it."""

    status: dict
    write: bool
    events: list[Event]

    @property
    def calls(self) -> bool:
        return self.write or bool(self.events)


def judge(body: dict, config: OperatorConfig, memory: Memory, acted: Acted, obs: Observation,
          decision: Decision | None = None, kv_probes: list[KVProbe] | None = None,
          parity: list[RouterParity] | None = None, seen: Seen | None = None) -> Concluded:
    """A pass's second half without I/O: status from `obs` (the children as they are after `acted`)
    and the events that report a change of state. `kv_probes` are the workers' KV health as the
    routers report it (None: not read)."""
    meta, old, spec, result = body["metadata"], body.get("status") or {}, acted.spec, acted.result
    model = _model_finding(acted, meta["name"], obs, seen or Seen())
    ready = condition_of(old, "Ready")
    events: list[Event] = []
    if result.error and ready.get("message") != result.error:
        # Once per distinct failure, not per pass.
        events.append(("Warning", "InvalidSpec" if spec is None else result.reason, result.error))
    if acted.applies or spec is None:
        # observedGeneration advances only once the spec it describes is applied.
        applied = not result.error and not (model is not None and model.blocking)
        generation = meta.get("generation") if applied else None
        apply_error, apply_reason = (None if spec is None else result.error), result.reason
    else:  # nothing applied: what the last apply found still holds
        failed = ready.get("reason") in ("ApplyFailed", REFUSED, policy.DENIED)
        generation, apply_error, apply_reason = None, ready["message"] if failed else None, ready.get("reason")
    status = _status(body, spec, config, generation, obs, decision, model=model, apply_error=apply_error,
                     apply_reason=apply_reason or "ApplyFailed", spec_error=acted.spec_error, kv_probes=kv_probes,
                     parity=parity)
    if acted.secret:
        status["internalSecret"] = acted.secret
    events += _warning_events(body, status, memory)
    events += [("Normal", c.reason, c.message) for c in acted.changes]
    return Concluded(status, not same_status(old, status), events)


def publish(api: client.ApiClient, body: dict, concluded: Concluded) -> str | None:
    """Writes what `judge` concluded (the status, if it changed; the events) and sets it in `body`.
    Returns the InferenceService's resourceVersion after the pass (None when it is gone)."""
    meta, old = body["metadata"], body.get("status") or {}
    version = meta.get("resourceVersion")
    warnings = [e for e in concluded.events if e[0] == "Warning"]
    for type_, reason, message in warnings:
        api_client.post_event(api, body, type_, reason, message)
    if concluded.write:
        version = api_client.write_status(api, meta["namespace"], meta["name"], concluded.status, old)
    body["status"] = concluded.status
    for type_, reason, message in concluded.events:
        if type_ != "Warning":
            log.info("%s/%s: %s", meta["namespace"], meta["name"], message)
            api_client.post_event(api, body, type_, reason, message)
    return version


def conclude(api: client.ApiClient, body: dict, config: OperatorConfig, memory: Memory, acted: Acted,
             obs: Observation, decision: Decision | None = None, kv_probes: list[KVProbe] | None = None,
             parity: list[RouterParity] | None = None, seen: Seen | None = None) -> str | None:
    """`judge`, then `publish`: status written once if it changed, the events. Returns the
    InferenceService's resourceVersion after the pass (None when it is gone)."""
    return publish(api, body, judge(body, config, memory, acted, obs, decision, kv_probes, parity, seen))
