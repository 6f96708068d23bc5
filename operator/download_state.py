"""A hub model's download Job (model.cache.pvc) -> the ModelReady condition. Pure.

The Job of the pinned commit (render.weights.download_job_name) is read in every pass, and its
watch events start one, so the condition follows the Job of the commit the spec pins now:

  no Job yet          Unknown  Downloading     the pass that creates it has not run (or failed: Ready says)
  running             Unknown  Downloading     with the failed attempts so far, the last one's line
  Complete            True     Downloaded
  Failed (or about    False    DownloadFailed  the line `tandem model download` printed (gated, not found,
  to: FailureTarget)                           unreachable) and how to retry; Ready=False with it

Downloading is Unknown, not False: nothing is wrong yet and nobody has to act (False is kept for
what a person must fix, and a False ModelReady makes Ready False, which would also mark a service
whose old pods serve through a rollout as not ready). The workers wait for the Job in their init
container and their role conditions say they are not ready.
"""

from __future__ import annotations

from typing import Any

from tandem.operator.status import condition

TYPE = "ModelReady"
CONTAINER = "download"  # the Job's one container (render.weights)


def _true(job: dict[str, Any], *types: str) -> dict[str, Any] | None:
    return next((c for c in (job.get("status") or {}).get("conditions") or []
                 if c.get("type") in types and c.get("status") == "True"), None)


def _terminated(pod: dict[str, Any]) -> dict[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            state = cs.get("state") or {}
            return state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
    return {}


def last_failure(pods: list[dict[str, Any]]) -> str | None:
    """The last line of the newest failed attempt's termination message (with FallbackToLogsOnError
    it is the log's tail: the one line `tandem model download` printed comes last), or its exit code."""
    failed = [(_terminated(p).get("finishedAt") or "", _terminated(p)) for p in pods
              if (p.get("status") or {}).get("phase") == "Failed"]
    if not failed:
        return None
    _, state = max(failed, key=lambda f: f[0])
    lines = [line.strip() for line in str(state.get("message") or "").splitlines() if line.strip()]
    if lines:
        return lines[-1]
    code = state.get("exitCode")
    return f"exited {code} ({state.get('reason') or 'no message'})" if code is not None else None


def download_condition(checked: str, job_name: str, claim: str, job: dict[str, Any] | None,
                       pods: list[dict[str, Any]]) -> dict[str, str]:
    """ModelReady from the download Job of the pinned commit and its pods; `checked` is what the
    model check said (the commit, and that its config.json can be served)."""
    if job is None:
        return condition(TYPE, "Unknown", "Downloading", f"{checked}; the download Job {job_name} is not created yet")
    if _true(job, "Complete"):
        return condition(TYPE, "True", "Downloaded", f"{checked}; downloaded into claim {claim} by Job {job_name}")
    line = last_failure(pods)
    failed = _true(job, "Failed", "FailureTarget")
    if failed is not None:
        why = line or failed.get("message") or "no message"
        return condition(TYPE, "False", "DownloadFailed", (
            f"the download Job {job_name} failed ({failed.get('reason') or 'Failed'}): {why}. Fix the cause (a "
            f"gated model: model.tokenSecretRef), then delete the Job: the operator creates it again"))
    attempts = int((job.get("status") or {}).get("failed") or 0)
    message = f"{checked}; downloading into claim {claim} (Job {job_name}); the workers wait for it"
    if attempts:
        limit = (job.get("spec") or {}).get("backoffLimit")
        message += (f"; {attempts} failed attempt{'s' if attempts > 1 else ''} so far (it retries {limit} times), "
                    f"the last: {line or 'no message'}")
    return condition(TYPE, "Unknown", "Downloading", message)
