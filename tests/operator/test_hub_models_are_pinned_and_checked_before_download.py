"""A hub model on the real control plane, against a local server that speaks the hub's HTTP API
(testing/fake_hub.py; the operator and every process get HF_ENDPOINT):

- a model the workers cannot serve (an unsupported architecture, a tensor size its heads do not
  divide) is refused from its config.json before anything is created: no pod, Job or claim;
- a gated model's revision is pinned to its commit in status and the kv_compat; one Job fills the
  shared claim through the fake hub with the token from its Secret (the test runs the Job's and the
  init container's own commands, as the kubelet would), the token shows up nowhere; a new revision
  is a new commit, a new Job and a new kv_compat;
- a prefill worker of one commit's kv_compat and a decode worker of the other's never exchange KV.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import openai
import pytest
from kubernetes import client
from tandem.contracts.internal_auth import SECRET_ENV
from tandem.testing.cluster import wait_until
from tandem.testing.fake_hub import FakeHub, Repo
from tandem.testing.inference_services import GVP
from tandem.testing.inference_services import condition as _cond
from tandem.testing.inference_services import create as _create
from tandem.testing.inference_services import read as _tis
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.kubelet import run_container
from tandem.testing.router_process import RouterProcess
from tandem.testing.worker_process import WorkerProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOKEN = "hf_" + secrets.token_hex(12)
CLASS = "tandem-test-rwx"
CPU = {"gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
DEEPSEEK = {"model_type": "deepseek_v3", "num_attention_heads": 8, "num_key_value_heads": 8,
            "kv_lora_rank": 64, "architectures": ["DeepseekV3ForCausalLM"]}


@pytest.fixture(scope="module")
def hub(toy_model_dir):
    repos = {"tiny/llama": Repo.from_folder(toy_model_dir),
             "tiny/gated": Repo.from_folder(toy_model_dir, refs=("main", "v1"), token=TOKEN),
             "tiny/deepseek": Repo({"config.json": json.dumps(DEEPSEEK).encode()})}
    with FakeHub(repos) as server:
        yield server


@pytest.fixture(scope="module")
def operator(start_operator, hub):
    """The operator with HF_ENDPOINT at the fake hub (as the chart's hub.endpoint sets it)."""
    old = os.environ.get("HF_ENDPOINT")
    os.environ["HF_ENDPOINT"] = hub.url
    try:
        # A test below mounts a model image of the test registry: the operator's policy allows it.
        return start_operator("--policy", json.dumps({"default": {"images": ["registry.test/models/"]}}))
    finally:
        os.environ.pop("HF_ENDPOINT") if old is None else os.environ.__setitem__("HF_ENDPOINT", old)


def _model_condition(api, ns: str, name: str, status: str) -> dict:
    def seen() -> dict | None:
        tis = _tis(api, ns, name)
        return tis if _cond(tis, "ModelReady").get("status") == status else None
    try:
        return wait_until(seen, timeout=90, what=f"{name} ModelReady={status}")
    except TimeoutError as e:
        raise AssertionError(f"{e}; status: {json.dumps(_tis(api, ns, name).get('status'), indent=1)}") from None


def _children(api, ns: str) -> dict[str, list[str]]:
    core, apps, batch = client.CoreV1Api(api), client.AppsV1Api(api), client.BatchV1Api(api)
    return {"Deployment": [d.metadata.name for d in apps.list_namespaced_deployment(ns).items],
            "Job": [j.metadata.name for j in batch.list_namespaced_job(ns).items],
            "PersistentVolumeClaim": [c.metadata.name for c in core.list_namespaced_persistent_volume_claim(ns).items],
            "Pod": [p.metadata.name for p in core.list_namespaced_pod(ns).items]}


def test_a_model_the_workers_cannot_serve_is_refused_before_anything_downloads(api, operator, namespace):
    _create(api, namespace, "mla", {"model": {"hub": "tiny/deepseek", "cache": {"pvc": {"size": "1Gi"}}},
                                    "prefill": CPU, "decode": CPU})
    tis = _model_condition(api, namespace, "mla", "False")
    model = _cond(tis, "ModelReady")
    assert model["reason"] == "UnsupportedModel"
    assert "model_type 'deepseek_v3' is not supported" in model["message"]
    assert "multi-head latent attention" in model["message"]
    assert _cond(tis, "Ready")["reason"] == "UnsupportedModel"
    assert tis["status"]["model"]["commit"] == operator_hub_commit(tis, "tiny/deepseek")

    _create(api, namespace, "tp3", {"model": {"hub": "tiny/llama"}, "prefill": CPU,
                                    "decode": CPU | {"parallelism": {"tensor": 3}}})
    model = _cond(_model_condition(api, namespace, "tp3", "False"), "ModelReady")
    assert model["reason"] == "ParallelismMismatch"
    assert "decode tensor parallelism 3 does not divide the model's 4 attention heads" in model["message"]
    assert _children(api, namespace) == {"Deployment": [], "Job": [], "PersistentVolumeClaim": [], "Pod": []}, \
        "nothing may start downloading a model that cannot be served"


def operator_hub_commit(tis: dict, repo: str) -> str:
    assert tis["status"]["model"]["hub"] == repo
    return tis["status"]["model"]["commit"]


@pytest.fixture
def rwx_volume(k8s, tmp_path):
    """A ReadWriteMany PersistentVolume of the test's storage class (no provisioner runs here)."""
    name = f"weights-{secrets.token_hex(3)}"
    with k8s.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_persistent_volume({"metadata": {"name": name}, "spec": {
            "capacity": {"storage": "5Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": CLASS,
            "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(tmp_path / "pv")}}})
        try:
            yield name
        finally:
            core.delete_persistent_volume(name)


def test_a_gated_model_is_pinned_downloaded_once_and_its_commit_is_its_kv_compat(
        k8s, api, operator, hub, namespace, rwx_volume, tmp_path, toy_model_dir, monkeypatch):
    client.CoreV1Api(api).create_namespaced_secret(namespace, {
        "metadata": {"name": "hf-token"}, "stringData": {"token": TOKEN}})
    spec = {"model": {"hub": "tiny/gated", "revision": "v1", "tokenSecretRef": {"name": "hf-token"},
                      "cache": {"pvc": {"size": "1Gi", "storageClassName": CLASS}}, "dtype": "float32"},
            "prefill": CPU, "decode": CPU, "kvTransfer": {"backend": "tcp"}}
    _create(api, namespace, "gated", spec)
    tis = _model_condition(api, namespace, "gated", "True")
    commit_a = hub.repos["tiny/gated"].commit
    assert tis["status"]["model"] == {"hub": "tiny/gated", "revision": "v1", "commit": commit_a,
                                      "checked": {"prefill": 1, "decode": 1}}
    assert commit_a in _cond(tis, "ModelReady")["message"]
    tis = wait_until(lambda: (t := _tis(api, namespace, "gated")) and _cond(t, "Ready").get("status") == "True" and t,
                     timeout=120, what="gated Ready")
    kv_compat_a = tis["status"]["kvCompat"]
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector="tandem.dev/role=decode").items
    assert {p.metadata.labels["tandem.dev/kv-compat"] for p in pods} == {kv_compat_a}

    claim = client.CoreV1Api(api).read_namespaced_persistent_volume_claim("gated-weights", namespace)
    assert claim.spec.access_modes == ["ReadWriteMany"] and claim.spec.volume_name == rwx_volume
    (job,) = client.BatchV1Api(api).list_namespaced_job(namespace).items
    job_container = api.sanitize_for_serialization(job.spec.template.spec.containers[0])
    assert job_container["command"][-2:] == ["--dest", f"/weights/tiny/gated/{commit_a}"] and commit_a in \
        job_container["command"]

    # The Job's download through the fake hub, then a worker's wait for it: one download.
    weights = tmp_path / "claim"
    before = hub.downloads("tiny/gated", "model.safetensors")
    done = run_container(api, namespace, job_container, {"/weights": weights})
    assert done.returncode == 0, done.stdout + done.stderr
    assert hub.downloads("tiny/gated", "model.safetensors") == before + 1
    folder = weights / "tiny" / "gated" / commit_a
    assert (folder / "model.safetensors").read_bytes() == (toy_model_dir / "model.safetensors").read_bytes()
    deployment = client.AppsV1Api(api).read_namespaced_deployment("gated-decode", namespace)
    (wait,) = api.sanitize_for_serialization(deployment.spec.template.spec.init_containers)
    assert run_container(api, namespace, wait, {"/weights": weights}).returncode == 0
    assert hub.downloads("tiny/gated", "model.safetensors") == before + 1, "the workers download nothing"

    # The token is in its Secret and nowhere else: not in the operator's log, nor in any child.
    assert TOKEN not in operator.log()
    for kind in ("configmaps", "deployments", "jobs", "persistentvolumeclaims", "pods"):
        listed = k8s.kubectl("get", kind, "-n", namespace, "-o", "json").stdout
        assert TOKEN not in listed, kind

    # Upstream moves on: revision v2 is another commit, another Job, another kv_compat.
    hub.repos["tiny/gated"] = Repo({**hub.repos["tiny/gated"].files, "README.md": b"v2\n"}, refs=("main", "v2"),
                                   token=TOKEN)
    commit_b = hub.repos["tiny/gated"].commit
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        *GVP[:2], namespace, GVP[2], "gated", {"spec": {"model": {"revision": "v2"}}})
    tis = wait_until(lambda: (t := _tis(api, namespace, "gated")) and t["status"].get("model", {}).get("commit") ==
                     commit_b and t["status"]["kvCompat"] != kv_compat_a and t, timeout=90, what="commit B pinned")
    kv_compat_b = tis["status"]["kvCompat"]
    wait_until(lambda: len(client.BatchV1Api(api).list_namespaced_job(namespace).items) == 2, timeout=60,
               what="a download Job for commit B")

    # The two kv_compat values never pair: a prefill worker of A and a decode worker of B exchange no KV.
    _never_exchange_kv(toy_model_dir, kv_compat_a, kv_compat_b, monkeypatch)


def _never_exchange_kv(model: Path, prefill_kv_compat: str, decode_kv_compat: str, monkeypatch) -> None:
    """A request through a router over one prefill and one decode worker: of different kv_compat values no
    KV moves (decode prefills itself); of the same kv_compat it does (the control)."""
    secret = secrets.token_urlsafe(32)
    monkeypatch.setenv(SECRET_ENV, secret)
    started = []

    def serve(prefill: WorkerProcess, decode_kv_compat: str) -> tuple[RouterProcess, WorkerProcess]:
        decode = WorkerProcess(model, "decode", "--kv-backend", "tcp", secret=secret,
                               env={"TANDEM_KV_COMPAT": decode_kv_compat})
        started.append(decode.start())
        router = RouterProcess("--prefill", prefill.url, "--decode", decode.url)
        started.append(router.start())
        answer = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120
                               ).completions.create(model=router.get_json("/v1/models")["data"][0]["id"],
                                                    prompt="A long enough prompt " * 20, max_tokens=8, temperature=0)
        assert answer.choices[0].text
        return router, decode

    try:
        prefill = WorkerProcess(model, "prefill", "--kv-backend", "tcp", secret=secret,
                                env={"TANDEM_KV_COMPAT": prefill_kv_compat})
        started.append(prefill.start())
        router, decode = serve(prefill, decode_kv_compat)
        assert router.metric('tandem_router_worker_requests_total{role="prefill"}') == 0, \
            "a prefill worker of another kv_compat got the prompt"
        assert router.metric('tandem_router_worker_requests_total{role="decode"}') >= 1
        assert _total(prefill, "tandem_kv_transfer_bytes_total") == 0
        router.stop(), decode.stop()
        router, _ = serve(prefill, prefill_kv_compat)  # the control: one kv_compat, disaggregated
        assert router.metric('tandem_router_worker_requests_total{role="prefill"}') >= 1
        assert _total(prefill, "tandem_kv_transfer_bytes_total") > 0
    finally:
        for proc in reversed(started):
            proc.stop()


def _total(proc, name: str) -> float:
    """A counter summed over its labels."""
    return sum(float(line.split()[-1]) for line in proc.get_text("/metrics").splitlines()
               if line.startswith(name + "{"))


def test_an_oci_image_source_reaches_the_pods_as_an_image_volume(api, operator, namespace):
    reference = "registry.test/models/tiny@sha256:" + "c" * 64
    _create(api, namespace, "car", {"model": {"image": {"reference": reference, "pullPolicy": "IfNotPresent"}},
                                    "prefill": CPU, "decode": CPU, "kvTransfer": {"backend": "tcp"}})
    tis = _model_condition(api, namespace, "car", "Unknown")
    assert _cond(tis, "ModelReady")["reason"] == "NotChecked"
    assert "with model.image each worker checks it when it starts" in _cond(tis, "ModelReady")["message"]
    pods = wait_until(lambda: client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector="tandem.dev/service=car,tandem.dev/role=decode").items, timeout=90,
        what="a decode pod")
    pod = api.sanitize_for_serialization(pods[0])
    assert {"name": "model", "image": {"reference": reference, "pullPolicy": "IfNotPresent"}} in pod["spec"]["volumes"]
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "model", "mountPath": "/model-image", "readOnly": True} in mounts
    config = client.CoreV1Api(api).read_namespaced_config_map("car-config", namespace).data["decode.yaml"]
    assert "model: /model-image/models" in config
