"""How a hub model's download goes -> the ModelReady condition. Pure.

With model.cache.pvc one Job downloads (download_condition); with a hostPath or emptyDir cache each
worker pod's init container does (pods_download_condition, below).

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
LINE_MAX = 1024  # of a termination message's last line, in a condition (the kubelet keeps up to 4 KiB)


def _true(job: dict[str, Any], *types: str) -> dict[str, Any] | None:
    return next((c for c in (job.get("status") or {}).get("conditions") or []
                 if c.get("type") in types and c.get("status") == "True"), None)


def _terminated(pod: dict[str, Any]) -> dict[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            state = cs.get("state") or {}
            return state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
    return {}


def why(terminated: dict[str, Any]) -> str:
    """The last line of a terminated container's message (with FallbackToLogsOnError it is the log's
    tail: the one line `tandem model download` printed comes last), or its exit code."""
    lines = [line.strip() for line in str(terminated.get("message") or "").splitlines() if line.strip()]
    if lines:
        return lines[-1][:LINE_MAX]
    return f"exited {terminated.get('exitCode')} ({terminated.get('reason') or 'no message'})"


def last_failure(pods: list[dict[str, Any]]) -> str | None:
    """Why the newest failed attempt of a Job failed (None: none failed)."""
    failed = [_terminated(p) for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
    failed = [t for t in failed if t]
    return why(max(failed, key=lambda t: t.get("finishedAt") or "")) if failed else None


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


def _init_failure(pod: dict[str, Any], init: str) -> dict[str, Any] | None:
    """The download init container's last end, if it failed and has not succeeded since."""
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") != init:
            continue
        state = cs.get("state") or {}
        ended = state.get("terminated") or ((cs.get("lastState") or {}).get("terminated") if "waiting" in state
                                            else None)
        return ended if ended and ended.get("exitCode") not in (None, 0) else None
    return None


def pods_download_condition(checked: dict[str, str], init: str, permanent: int,
                            pods: list[dict[str, Any]]) -> dict[str, str]:
    """ModelReady when each worker pod downloads for itself (its init container `init`, retried by
    the kubelet for ever): `checked` as it was while none failed; DownloadFailed when one failed in a
    way trying again cannot help (exit code `permanent`), Downloading with the line while retrying."""
    failed = [(pod["metadata"]["name"], ended) for pod in pods if (ended := _init_failure(pod, init))]
    if not failed:
        return checked
    hopeless = [(name, ended) for name, ended in failed if ended.get("exitCode") == permanent]
    name, ended = (hopeless or failed)[0]
    where = f"{len(failed)} of {len(pods)} worker pods could not download the weights; pod {name}: {why(ended)}"
    if hopeless:
        return condition(TYPE, "False", "DownloadFailed", (
            f"{where}. Trying again cannot help: fix the cause (a gated model: model.tokenSecretRef); the pods "
            "retry on their own"))
    return condition(TYPE, "Unknown", "Downloading", f"{checked['message']}; {where}; retrying")
