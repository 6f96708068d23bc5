"""ModelReady from what the operator reads besides the hub (pure): a model.pvc claim against where the
workers run (operator/claim_check.py), a hub model's download Job or the worker pods' own download
init containers (operator/download_state.py), and how a pass that does not check carries them
(model_check.carried)."""

from __future__ import annotations

import pytest
from tandem.operator import model_check
from tandem.operator.claim_check import judge_claim, most_worker_pods
from tandem.operator.download_state import download_condition, last_failure, pods_download_condition
from tandem.operator.status import Observation, compute_conditions

CHECKED = "tiny/llama@main is commit abc; its config.json can be served"


def _claim(*modes: str) -> dict:
    return {"metadata": {"name": "models"}, "spec": {"accessModes": list(modes)}}


@pytest.fixture
def pvc_spec(typed):
    def make(decode: dict | None = None, **extra) -> object:
        return typed({"model": {"pvc": {"claimName": "models"}}, "prefill": {"replicas": 1},
                      "decode": {"replicas": 1} | (decode or {}), **extra})
    return make


def test_a_claim_that_mounts_on_many_nodes_is_fine(pvc_spec):
    for modes in (("ReadOnlyMany",), ("ReadWriteMany",), ("ReadWriteOnce", "ReadOnlyMany")):
        assert judge_claim(_claim(*modes), pvc_spec({"replicas": 4})) is None, modes


def test_a_missing_claim_is_said_but_does_not_stop_the_apply(pvc_spec):
    problem = judge_claim(None, pvc_spec())
    assert (problem.status, problem.reason, problem.blocking) == ("False", "ClaimNotFound", False)
    assert "'models'" in problem.message and "wait (Pending) until it exists" in problem.message


def test_read_write_once_pod_is_refused_even_for_one_pod_per_role(pvc_spec):
    problem = judge_claim(_claim("ReadWriteOncePod"), pvc_spec())
    assert (problem.status, problem.reason, problem.blocking) == ("False", "ClaimSinglePod", True)
    assert "up to 2 worker pods, one more during a rollout" in problem.message
    assert "use a ReadOnlyMany or ReadWriteMany claim" in problem.message


def test_read_write_once_warns_unless_a_group_spans_nodes(pvc_spec):
    problem = judge_claim(_claim("ReadWriteOnce"), pvc_spec({"replicas": 3}))
    assert (problem.status, problem.reason, problem.blocking) == ("Unknown", "ClaimSingleNode", False)
    assert "claim models has accessModes ['ReadWriteOnce']" in problem.message
    assert "up to 4 worker pods" in problem.message and "Multi-Attach" in problem.message
    grouped = pvc_spec({"gpus": 1, "parallelism": {"tensor": 2, "nodes": 2}})
    problem = judge_claim(_claim("ReadWriteOnce"), grouped)
    assert (problem.status, problem.reason, problem.blocking) == ("False", "ClaimSingleNode", True)
    assert "a decode group spans nodes" in problem.message


def test_the_most_pods_count_an_autoscaled_roles_maximum_and_groups(pvc_spec):
    assert most_worker_pods(pvc_spec({"replicas": 2, "gpus": 1, "parallelism": {"tensor": 2, "nodes": 2}})) == 5
    scaled = pvc_spec(autoscaling={"decode": {"minReplicas": 1, "maxReplicas": 6}})
    assert most_worker_pods(scaled) == 7
    external = pvc_spec(autoscaling={"decode": {"mode": "External"}})
    assert "any number of (an external autoscaler decides)" in judge_claim(_claim("ReadWriteOnce"), external).message


def _job(*conditions: tuple[str, str], failed: int = 0) -> dict:
    return {"metadata": {"name": "dl-dl-1", "uid": "u"}, "spec": {"backoffLimit": 6},
            "status": {"failed": failed, "conditions": [
                {"type": t, "status": "True", "reason": r, "message": f"{t} says so"} for t, r in conditions]}}


def _failed_pod(finished: str, message: str | None, code: int = 1) -> dict:
    terminated = {"exitCode": code, "reason": "Error", "finishedAt": finished}
    if message is not None:
        terminated["message"] = message
    return {"status": {"phase": "Failed", "containerStatuses": [{"name": "download",
                                                                  "state": {"terminated": terminated}}]}}


def test_the_download_job_sets_model_ready():
    def cond(job, pods=()):
        return download_condition(CHECKED, "dl-dl-1", "dl-weights", job, list(pods))

    assert cond(None)["status"] == "Unknown" and "Job dl-dl-1 is not created yet" in cond(None)["message"]
    running = cond(_job())
    assert (running["status"], running["reason"]) == ("Unknown", "Downloading")
    assert running["message"].startswith(CHECKED) and "(Job dl-dl-1)" in running["message"]
    pods = [_failed_pod("2026-01-01T00:00:09Z", "Fetching 3 files\ntandem model download: newer\n"),
            _failed_pod("2026-01-01T00:00:01Z", "tandem model download: older")]
    retrying = cond(_job(failed=2), pods)
    assert "2 failed attempts so far (it retries 6 times), the last: tandem model download: newer" \
        in retrying["message"]
    done = cond(_job(("Complete", "")))
    assert (done["status"], done["reason"]) == ("True", "Downloaded") and "by Job dl-dl-1" in done["message"]
    for kind, reason in (("Failed", "BackoffLimitExceeded"), ("FailureTarget", "PodFailurePolicy")):
        failed = cond(_job((kind, reason), failed=2), pods)
        assert (failed["status"], failed["reason"]) == ("False", "DownloadFailed")
        assert failed["message"].startswith(f"the download Job dl-dl-1 failed ({reason}): "
                                            "tandem model download: newer. Fix the cause")
    assert "Failed says so" in cond(_job(("Failed", "DeadlineExceeded")))["message"], "no pod: the Job's words"


def test_a_failed_attempt_without_a_message_gives_its_exit_code():
    assert last_failure([_failed_pod("t", None, 137)]) == "exited 137 (Error)"
    assert last_failure([{"status": {"phase": "Running"}}]) is None
    assert len(last_failure([_failed_pod("t", "x" * 4096)])) == 1024, "a condition holds a bounded line"


def test_model_ready_downloading_leaves_ready_to_the_roles_and_a_failure_makes_it_false(pvc_spec):
    spec = pvc_spec()
    downloading = {"type": "ModelReady", "status": "Unknown", "reason": "Downloading", "message": "m"}
    ready = compute_conditions(spec, Observation(), model=downloading)[0]
    assert ready["reason"] == "DeploymentMissing"
    failed = {"type": "ModelReady", "status": "False", "reason": "DownloadFailed", "message": "why"}
    assert compute_conditions(spec, Observation(), model=failed)[0] == {
        "type": "Ready", "status": "False", "reason": "DownloadFailed", "message": "why"}


def test_a_pass_that_does_not_check_starts_again_from_the_checked_commit(typed, pvc_spec):
    spec = typed({"model": {"hub": "tiny/llama", "cache": {"pvc": {"size": "1Gi"}}}})
    held = {"hub": "tiny/llama", "revision": "main", "commit": "c0ffee", "checked": {"prefill": 1, "decode": 1}}
    body = {"status": {"model": held, "conditions": [
        {"type": "ModelReady", "status": "False", "reason": "DownloadFailed", "message": "old"}]}}
    finding = model_check.carried(body, spec)
    assert finding.condition["reason"] == "Checked" and not finding.blocking
    assert finding.spec.model.revision == "c0ffee" and model_check.downloads(finding)
    missing = {"status": {"conditions": [
        {"type": "ModelReady", "status": "False", "reason": "ClaimNotFound", "message": "no claim"}]}}
    finding = model_check.carried(missing, pvc_spec())
    assert finding.condition["reason"] == "ClaimNotFound" and not finding.blocking, "a missing claim applies"


def _worker(name: str, state: dict, last: dict | None = None) -> dict:
    status = {"name": "download-weights", "state": state, **({"lastState": last} if last else {})}
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "initContainerStatuses": [status]}}


def test_pods_that_download_for_themselves_fail_or_retry_in_model_ready():
    checked = {"type": "ModelReady", "status": "True", "reason": "Checked", "message": CHECKED}

    def cond(*pods):
        return pods_download_condition(checked, "download-weights", 3, list(pods))

    def ended(code, message):
        return {"terminated": {"exitCode": code, "message": message}}

    fine = _worker("a", ended(0, ""), ended(1, "tandem model download: once"))
    assert cond(fine, _worker("b", {"running": {}})) == checked, "a failure since overcome is no failure"
    crashing = _worker("c", {"waiting": {"reason": "CrashLoopBackOff"}}, ended(1, "x\ntandem model download: flaky"))
    retrying = cond(fine, crashing)
    assert (retrying["status"], retrying["reason"]) == ("Unknown", "Downloading")
    assert retrying["message"] == (f"{CHECKED}; 1 of 2 worker pods could not download the weights; pod c: "
                                   "tandem model download: flaky; retrying")
    gated = _worker("d", ended(3, "tandem model download: tiny/x is gated"))
    failed = cond(crashing, gated)
    assert (failed["status"], failed["reason"]) == ("False", "DownloadFailed")
    assert failed["message"].startswith("2 of 2 worker pods could not download the weights; pod d: "
                                        "tandem model download: tiny/x is gated. Trying again cannot help")
