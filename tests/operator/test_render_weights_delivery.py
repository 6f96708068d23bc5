"""How the weights reach the workers, rendered (pure, no cluster): a hub model pinned to its commit
in a shared claim filled by one download Job, a node-local cache, a bounded emptyDir, or an OCI
image volume; the commit is part of the kv_compat; the token reaches only the download steps."""

from __future__ import annotations

import json

import yaml
from tandem.operator.config import OperatorConfig
from tandem.operator.model_check import judge, pinned
from tandem.operator.render import kv_compat_hash, render

CONFIG = OperatorConfig(image_repository="registry.local/tandem", image_tag="1.2.3", pull_policy="IfNotPresent",
                        hub_endpoint="https://hub.mirror.example")
COMMIT = "a" * 40
TOKEN_REF = {"name": "hf", "key": "token"}


def _by(manifests: list[dict], kind: str, name: str | None = None) -> dict:
    return next(m for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name))


def _pod(manifests: list[dict], role: str) -> dict:
    return _by(manifests, "Deployment", f"llama-{role}")["spec"]["template"]["spec"]


def _hub(typed, cache: dict | None = None, **model: object) -> object:
    spec = {"model": {"hub": "org/tiny", "revision": "main", "tokenSecretRef": TOKEN_REF, **model}}
    if cache is not None:
        spec["model"]["cache"] = cache
    return pinned(typed(spec), COMMIT)


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_a_shared_claim_is_filled_once_by_a_job_and_read_by_every_worker(typed, meta):
    spec = _hub(typed, {"pvc": {"size": "50Gi", "storageClassName": "nfs"}})
    out = render(meta, spec, CONFIG)
    folder = f"/weights/org/tiny/{COMMIT}"
    claim = _by(out, "PersistentVolumeClaim", "llama-weights")
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "50Gi"}},
                             "storageClassName": "nfs"}
    job = _by(out, "Job")
    assert len(job["metadata"]["name"]) <= 63 and job["metadata"]["name"].startswith("llama-dl-")
    pod = job["spec"]["template"]["spec"]
    (download,) = pod["containers"]
    assert download["command"] == ["tandem", "model", "download", "--hub", "org/tiny", "--revision", COMMIT,
                                   "--dest", folder]
    env = _env(download)
    assert env["HF_ENDPOINT"] == "https://hub.mirror.example"
    assert env["HF_TOKEN"] == {"secretKeyRef": TOKEN_REF}, "the token comes from its Secret, never as a value"
    assert pod["volumes"] == [{"name": "weights", "persistentVolumeClaim": {"claimName": "llama-weights"}}]
    assert download["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert out.index(claim) < out.index(job) < out.index(_by(out, "Deployment", "llama-prefill"))
    for role in ("prefill", "decode"):
        worker_pod = _pod(out, role)
        (wait,) = worker_pod["initContainers"]
        assert wait["command"] == ["tandem", "model", "wait", "--dir", folder]
        assert "HF_TOKEN" not in _env(wait) and "HF_TOKEN" not in _env(worker_pod["containers"][0])
        assert {"name": "weights", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}} in \
            worker_pod["volumes"]
        worker = worker_pod["containers"][0]
        assert {"name": "weights", "mountPath": "/weights", "readOnly": True} in worker["volumeMounts"]
        assert _env(worker)["HF_HUB_OFFLINE"] == "1", "a worker never downloads"
        config = yaml.safe_load(_by(out, "ConfigMap")["data"][f"{role}.yaml"])
        assert config["model"] == folder


def test_a_node_cache_or_an_emptydir_is_filled_by_each_pods_init_container(typed, meta):
    node = render(meta, _hub(typed, {"hostPath": {"path": "/var/cache/tandem"}}), CONFIG)
    pod = _pod(node, "decode")
    assert {"name": "weights", "hostPath": {"path": "/var/cache/tandem", "type": "DirectoryOrCreate"}} in pod["volumes"]
    (fetch,) = pod["initContainers"]
    assert fetch["command"][:3] == ["tandem", "model", "download"] and "--revision" in fetch["command"]
    assert fetch["volumeMounts"] == [{"name": "weights", "mountPath": "/weights", "readOnly": False}]
    assert _env(fetch)["HF_TOKEN"] == {"secretKeyRef": TOKEN_REF}
    assert not [m for m in node if m["kind"] in ("Job", "PersistentVolumeClaim")]
    default = _pod(render(meta, _hub(typed), CONFIG), "prefill")
    assert {"name": "weights", "emptyDir": {"sizeLimit": "200Gi"}} in default["volumes"], "never unbounded"
    sized = _pod(render(meta, _hub(typed, {"emptyDir": {"sizeLimit": "30Gi"}}), CONFIG), "prefill")
    assert {"name": "weights", "emptyDir": {"sizeLimit": "30Gi"}} in sized["volumes"]


def test_an_oci_image_is_mounted_as_an_image_volume(typed, meta):
    spec = typed({"model": {"image": {"reference": "registry.io/models/tiny@sha256:" + "b" * 64,
                                      "pullPolicy": "IfNotPresent"}}})
    out = render(meta, spec, CONFIG)
    pod = _pod(out, "decode")
    assert {"name": "model", "image": {"reference": "registry.io/models/tiny@sha256:" + "b" * 64,
                                       "pullPolicy": "IfNotPresent"}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/model-image", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert yaml.safe_load(_by(out, "ConfigMap")["data"]["decode.yaml"])["model"] == "/model-image/models"
    assert "initContainers" not in pod


def test_the_commit_and_the_image_are_part_of_the_kv_compat(typed):
    spec = typed({"model": {"hub": "org/tiny"}})
    assert kv_compat_hash(pinned(spec, "a" * 40), CONFIG) != kv_compat_hash(pinned(spec, "b" * 40), CONFIG)
    image = typed({"model": {"image": {"reference": "r.io/m:1"}}})
    other = typed({"model": {"image": {"reference": "r.io/m:2"}}})
    assert kv_compat_hash(image, CONFIG) != kv_compat_hash(other, CONFIG)


def test_no_token_value_is_ever_rendered(typed, meta):
    shared = json.dumps(render(meta, _hub(typed, {"pvc": {"size": "1Gi"}}), CONFIG))
    assert shared.count('"secretKeyRef": {"name": "hf"') == 1, "only the download Job has the token"
    per_pod = json.dumps(render(meta, _hub(typed), CONFIG))
    assert per_pod.count('"secretKeyRef": {"name": "hf"') == 2, "each role's download init container"
    assert '"name": "HF_TOKEN", "value"' not in shared + per_pod


def test_config_json_is_judged_with_the_workers_own_words(typed):
    config = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
    assert judge(config, typed({"model": {"hub": "o/m"}})) is None
    assert judge(config, typed({"model": {"hub": "o/m"}, "decode": {"gpus": 2, "parallelism": {"tensor": 2}}})) is None
    reason, message = judge(config, typed({"model": {"hub": "o/m"}, "decode": {"gpus": 3, "parallelism": {"tensor": 3}}}))
    assert reason == "ParallelismMismatch"
    assert message == "decode tensor parallelism 3 does not divide the model's 4 attention heads (choose a divisor of 4)"
    experts = config | {"model_type": "mixtral", "num_local_experts": 6}
    reason, message = judge(experts, typed({"model": {"hub": "o/m"}, "prefill": {"gpus": 4, "parallelism": {"tensor": 4}}}))
    assert reason == "ParallelismMismatch" and message.startswith("prefill.parallelism: ")
    reason, message = judge({"model_type": "deepseek_v3"}, typed({"model": {"hub": "o/m"}}))
    assert reason == "UnsupportedModel" and "multi-head latent attention" in message
