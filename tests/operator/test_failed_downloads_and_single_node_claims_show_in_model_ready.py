"""What goes wrong with the weights shows in the InferenceService's own status, on the real control
plane (the Job controller runs; the operator runs with the Helm chart's RBAC):

- a hub model's download Job: ModelReady Downloading while it runs, DownloadFailed with the line
  `tandem model download` printed once it failed (Ready=False with it, one Warning event), created
  again once deleted (how a download is retried), and a new commit's Job followed from Downloading
  to Downloaded. The claim is left unbound, so no node runs
  the Job's pod: the test runs the Job's own command against the fake hub and writes its end into
  the pod's status, as the kubelet would;
- pods that download for themselves (an emptyDir cache): their init container's failure, the same
  way (DownloadFailed when trying again cannot help), and ModelReady back once it succeeds;
- a `model.pvc` claim that does not exist (ClaimNotFound: still applied), mounts on one node only
  (ReadWriteOnce: a warning, still applied) or in one pod only (ReadWriteOncePod: nothing applied).
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.fake_hub import FakeHub, Repo
from tandem.testing.inference_services import GVP
from tandem.testing.inference_services import condition as _cond
from tandem.testing.inference_services import create as _create
from tandem.testing.inference_services import read as _tis
from tandem.testing.k8s_events import events_of, wait_events
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.kubelet import end_init_container, finish_pod, run_container
from tandem.weights.cli import EXIT_PERMANENT

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CPU = {"gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
UNBOUND = "tandem-test-no-volumes"  # a storage class no PersistentVolume has: claims stay Pending
NOWHERE = CPU | {"nodeSelector": {POOL_LABEL: "none-such"}}  # no node: KWOK leaves the pods to the test


@pytest.fixture(scope="module")
def hub(toy_model_dir):
    with FakeHub({"tiny/llama": Repo.from_folder(toy_model_dir, refs=("main", "v1")),
                  "tiny/solo": Repo.from_folder(toy_model_dir)}) as server:
        yield server


@pytest.fixture(scope="module")
def operator(start_operator, chart_rbac, hub):
    """The operator with the chart's own RBAC and HF_ENDPOINT at the fake hub."""
    old = os.environ.get("HF_ENDPOINT")
    os.environ["HF_ENDPOINT"] = hub.url
    try:
        return start_operator(kubeconfig=chart_rbac().kubeconfig)
    finally:
        os.environ.pop("HF_ENDPOINT") if old is None else os.environ.__setitem__("HF_ENDPOINT", old)


def _model_ready(api, ns: str, name: str, reason: str, containing: str = "", timeout: float = 90) -> dict:
    """The InferenceService once ModelReady has `reason` and its message contains `containing`."""
    def seen() -> dict | None:
        tis = _tis(api, ns, name)
        cond = _cond(tis, "ModelReady")
        return tis if cond.get("reason") == reason and containing in cond.get("message", "") else None
    try:
        return wait_until(seen, timeout=timeout, what=f"{name} ModelReady {reason} {containing!r}")
    except TimeoutError as e:
        raise AssertionError(f"{e}; status: {json.dumps(_tis(api, ns, name).get('status'), indent=1)}") from None


def _job_pod(api, ns: str, job: str) -> str:
    pods = wait_until(lambda: client.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=f"batch.kubernetes.io/job-name={job}").items, timeout=60, what=f"a pod of Job {job}")
    return pods[0].metadata.name


def _passes(operator) -> float:
    """Passes the operator has run (its own /metrics)."""
    url = operator.liveness.replace("/healthz", "/metrics")
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("tandem_operator_reconciles_total{"))


def _warnings(api, ns: str, name: str, reason: str) -> int:
    return sum(e.count or 1 for e in events_of(api, ns, name, "InferenceService")
               if e.type == "Warning" and e.reason == reason)


def test_a_failed_download_shows_in_status_and_a_new_commit_follows_its_own_job(api, operator, hub, namespace,
                                                                                  tmp_path):
    _create(api, namespace, "dl", {"model": {"hub": "tiny/llama", "revision": "v1",
                                             "cache": {"pvc": {"size": "1Gi", "storageClassName": UNBOUND}}},
                                   "prefill": CPU, "decode": CPU, "kvTransfer": {"backend": "tcp"}})
    batch = client.BatchV1Api(api)
    (job,) = wait_until(lambda: batch.list_namespaced_job(namespace).items, timeout=90, what="the download Job")
    name_a = job.metadata.name
    tis = _model_ready(api, namespace, "dl", "Downloading", f"(Job {name_a})")
    assert _cond(tis, "ModelReady")["status"] == "Unknown"
    assert hub.repos["tiny/llama"].commit in _cond(tis, "ModelReady")["message"]

    # The repo goes away upstream: the Job's own command says so in one line and exits EXIT_PERMANENT.
    repo_a = hub.repos.pop("tiny/llama")
    container = api.sanitize_for_serialization(job.spec.template.spec.containers[0])
    done = run_container(api, namespace, container, {"/weights": tmp_path / "claim"})
    assert done.returncode == EXIT_PERMANENT, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "tiny/llama does not exist" in line
    finish_pod(api, namespace, _job_pod(api, namespace, name_a), done.returncode, done.stdout + done.stderr)

    # The Job fails at once (its podFailurePolicy), and status says why in the download's own words.
    tis = _model_ready(api, namespace, "dl", "DownloadFailed", line)
    model = _cond(tis, "ModelReady")
    assert model["status"] == "False" and f"the download Job {name_a} failed (PodFailurePolicy)" in model["message"]
    assert "delete the Job" in model["message"]
    assert (_cond(tis, "Ready")["status"], _cond(tis, "Ready")["reason"]) == ("False", "DownloadFailed")
    assert batch.read_namespaced_job(name_a, namespace).status.failed == 1, "no retry of a permanent failure"
    wait_events(api, namespace, "dl", lambda e: e.type == "Warning" and e.reason == "DownloadFailed",
                "a DownloadFailed Warning", kind="InferenceService")
    passes = _passes(operator)
    wait_until(lambda: _passes(operator) >= passes + 4, timeout=60, what="four more passes")
    assert _warnings(api, namespace, "dl", "DownloadFailed") == 1, "one Warning per transition, not per pass"

    # The cause fixed, the failed Job deleted (as the message says): the operator creates it again.
    hub.repos["tiny/llama"] = repo_a
    uid_a = job.metadata.uid
    batch.delete_namespaced_job(name_a, namespace, propagation_policy="Background")
    wait_until(lambda: [j for j in batch.list_namespaced_job(namespace).items if j.metadata.uid != uid_a],
               timeout=60, what=f"Job {name_a} created again")
    tis = _model_ready(api, namespace, "dl", "Downloading", f"(Job {name_a})")
    assert "failed attempt" not in _cond(tis, "ModelReady")["message"]
    assert _cond(tis, "Ready")["reason"] != "DownloadFailed"

    # A new revision is a new commit and a new Job: the condition follows that one.
    hub.repos["tiny/llama"] = Repo({**repo_a.files, "README.md": b"v2\n"}, refs=("main", "v2"))
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        *GVP[:2], namespace, GVP[2], "dl", {"spec": {"model": {"revision": "v2"}}})
    jobs = wait_until(lambda: [j for j in batch.list_namespaced_job(namespace).items if j.metadata.name != name_a],
                      timeout=90, what="the download Job of commit v2")
    name_b = jobs[0].metadata.name
    tis = _model_ready(api, namespace, "dl", "Downloading", f"(Job {name_b})")
    assert tis["status"]["model"]["commit"] == hub.repos["tiny/llama"].commit != repo_a.commit
    assert _cond(tis, "Ready")["reason"] != "DownloadFailed"
    finish_pod(api, namespace, _job_pod(api, namespace, name_b), 0)
    tis = _model_ready(api, namespace, "dl", "Downloaded", f"by Job {name_b}")
    assert _cond(tis, "ModelReady")["status"] == "True"


def test_pods_that_download_for_themselves_say_why_they_cannot(api, operator, hub, namespace, tmp_path):
    _create(api, namespace, "solo", {"model": {"hub": "tiny/solo"}, "prefill": NOWHERE | {"replicas": 0},
                                     "decode": NOWHERE, "kvTransfer": {"backend": "tcp"}})
    _model_ready(api, namespace, "solo", "Checked")
    (pod,) = wait_until(lambda: client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector="tandem.dev/service=solo,tandem.dev/role=decode").items, timeout=60,
        what="the decode pod")
    init = api.sanitize_for_serialization(pod.spec.init_containers[0])
    assert init["name"] == "download-weights"
    hub.repos.pop("tiny/solo")
    done = run_container(api, namespace, init, {"/weights": tmp_path / "cache"})
    assert done.returncode == EXIT_PERMANENT, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    end_init_container(api, namespace, pod.metadata.name, done.returncode, done.stdout + done.stderr)

    tis = _model_ready(api, namespace, "solo", "DownloadFailed", f"pod {pod.metadata.name}: {line}")
    assert _cond(tis, "ModelReady")["status"] == "False"
    assert "1 of 1 worker pods could not download the weights" in _cond(tis, "ModelReady")["message"]
    assert (_cond(tis, "Ready")["status"], _cond(tis, "Ready")["reason"]) == ("False", "DownloadFailed")
    wait_events(api, namespace, "solo", lambda e: e.type == "Warning" and e.reason == "DownloadFailed",
                "a DownloadFailed Warning", kind="InferenceService")
    end_init_container(api, namespace, pod.metadata.name, 0)  # the cause fixed, the kubelet's next try
    assert _cond(_model_ready(api, namespace, "solo", "Checked"), "ModelReady")["status"] == "True"


def _claim(api, ns: str, name: str, modes: list[str]) -> None:
    client.CoreV1Api(api).create_namespaced_persistent_volume_claim(ns, {
        "metadata": {"name": name}, "spec": {"accessModes": modes, "storageClassName": UNBOUND,
                                             "resources": {"requests": {"storage": "1Gi"}}}})


def _deployments(api, ns: str, service: str) -> list[str]:
    return sorted(d.metadata.name for d in client.AppsV1Api(api).list_namespaced_deployment(
        ns, label_selector=f"tandem.dev/service={service}").items)


def test_a_claim_missing_or_mounting_on_one_node_says_so_in_model_ready(api, operator, namespace):
    def service(name: str, claim: str, decode_replicas: int = 2) -> None:
        _create(api, namespace, name, {"model": {"pvc": {"claimName": claim}}, "prefill": CPU,
                                       "decode": CPU | {"replicas": decode_replicas}, "kvTransfer": {"backend": "tcp"}})

    # Missing: said, and still applied (the pods start once the claim exists).
    service("missing", "models")
    tis = _model_ready(api, namespace, "missing", "ClaimNotFound", "'models'")
    assert _cond(tis, "ModelReady")["status"] == "False"
    assert (_cond(tis, "Ready")["status"], _cond(tis, "Ready")["reason"]) == ("False", "ClaimNotFound")
    wait_until(lambda: _deployments(api, namespace, "missing") == ["missing-decode", "missing-prefill",
                                                                   "missing-router"], timeout=60, what="applied")
    wait_events(api, namespace, "missing", lambda e: e.type == "Warning" and e.reason == "ClaimNotFound",
                "a ClaimNotFound Warning", kind="InferenceService")
    _claim(api, namespace, "models", ["ReadOnlyMany"])
    _model_ready(api, namespace, "missing", "NotChecked", "with model.pvc each worker checks it")

    # ReadWriteOnce: a warning (the pods may all land on one node), still applied.
    _claim(api, namespace, "rwo", ["ReadWriteOnce"])
    service("rwo", "rwo")
    tis = _model_ready(api, namespace, "rwo", "ClaimSingleNode")
    model = _cond(tis, "ModelReady")
    assert model["status"] == "Unknown"
    assert "claim rwo has accessModes ['ReadWriteOnce']: it mounts on one node only" in model["message"]
    assert "up to 3 worker pods" in model["message"] and "ReadOnlyMany or ReadWriteMany" in model["message"]
    assert _cond(tis, "Ready")["reason"] != "ClaimSingleNode"
    wait_until(lambda: len(_deployments(api, namespace, "rwo")) == 3, timeout=60, what="rwo applied")
    wait_events(api, namespace, "rwo", lambda e: e.type == "Warning" and e.reason == "ClaimSingleNode",
                "a ClaimSingleNode Warning", kind="InferenceService")

    # ReadWriteOncePod: a second pod never starts; nothing is applied.
    _claim(api, namespace, "rwop", ["ReadWriteOncePod"])
    service("rwop", "rwop", decode_replicas=1)
    tis = _model_ready(api, namespace, "rwop", "ClaimSinglePod")
    model = _cond(tis, "ModelReady")
    assert model["status"] == "False" and "it mounts in one pod only" in model["message"]
    assert "one more during a rollout" in model["message"]
    assert (_cond(tis, "Ready")["status"], _cond(tis, "Ready")["reason"]) == ("False", "ClaimSinglePod")
    wait_events(api, namespace, "rwop", lambda e: e.type == "Warning" and e.reason == "ClaimSinglePod",
                "a ClaimSinglePod Warning", kind="InferenceService")
    assert _deployments(api, namespace, "rwop") == []
