"""How the weights reach a worker pod: volumes, mounts, init containers, and for a shared cache the
claim and the one download Job. Pure.

  model.path          a folder in the worker image: nothing to mount
  model.hostPath      the node's folder, read-only at /models
  model.pvc           the user's claim (and subPath), read-only at /models
  model.image         an OCI image as an image volume, read-only at /model-image (+ image.path)
  model.hub           the commit (spec.model.revision once the operator pinned it) under /weights:
    cache.pvc         claim <name>-weights (ReadWriteMany); Job <name>-dl-<hash of hub and commit>
                      fills it once; each worker waits for it in an init container and mounts it
                      read-only
    cache.hostPath    the node's folder: an init container downloads (once per node: a file lock)
    cache.emptyDir    (default, bounded) each pod's init container downloads for itself

The hub token reaches only the downloading containers, from its Secret (secretKeyRef); workers of a
hub model run with HF_HUB_OFFLINE=1: nothing but the download step ever talks to the hub.
"""

from __future__ import annotations

from typing import Any

from tandem.operator.config import OperatorConfig
from tandem.operator.render.identity import image_ref, short_hash
from tandem.operator.render.objects import Manifest, metadata, names
from tandem.operator.spec import InferenceServiceSpec
from tandem.operator.spec.model import DEFAULT_HUB_CACHE_LIMIT, Model
from tandem.weights.cli import EXIT_PERMANENT

DOWNLOAD_INIT = "download-weights"  # the init container of a pod that downloads for itself
MODEL_DIR = "/models"  # where a hostPath or PVC model is mounted
IMAGE_DIR = "/model-image"  # where an image volume is mounted
WEIGHTS_DIR = "/weights"  # a hub model's cache: <org>/<name>/<commit> below it
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
    "runAsNonRoot": True,
}


def hub_folder(model: Model) -> str:
    """The pinned commit's folder under WEIGHTS_DIR (spec.model.revision is the commit by then)."""
    return "/".join([WEIGHTS_DIR, *str(model.hub).split("/"), model.hub_revision])


def model_arg(spec: InferenceServiceSpec) -> str:
    """What the worker's --model gets: always a folder in the container."""
    model = spec.model
    if model.path is not None:
        return model.path
    if model.image is not None:
        return IMAGE_DIR + model.image.path.rstrip("/") if model.image.path != "/" else IMAGE_DIR
    if model.hub is not None:
        return hub_folder(model)
    return MODEL_DIR  # hostPath and pvc are mounted here


def download_env(spec: InferenceServiceSpec, config: OperatorConfig) -> list[dict[str, Any]]:
    """The hub, its token (from the Secret, never a value) and a writable HF_HOME."""
    env: list[dict[str, Any]] = [
        {"name": "HF_ENDPOINT", "value": config.hub_endpoint},
        {"name": "HF_HOME", "value": f"{WEIGHTS_DIR}/.hf-home"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    ref = spec.model.token_secret_ref
    if ref is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def _download_container(name: str, command: list[str], spec: InferenceServiceSpec, config: OperatorConfig,
                        read_only: bool) -> dict[str, Any]:
    image, pull_policy = image_ref(spec, config)
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": command,
        "env": download_env(spec, config) if not read_only else [],
        "volumeMounts": [{"name": "weights", "mountPath": WEIGHTS_DIR, "readOnly": read_only}],
        "securityContext": dict(RESTRICTED),
        # The last lines of a failed download (why, in one line) become its termination message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _download_command(model: Model) -> list[str]:
    return ["tandem", "model", "download", "--hub", str(model.hub), "--revision", model.hub_revision,
            "--dest", hub_folder(model)]


def weights_pod_parts(name: str, spec: InferenceServiceSpec, config: OperatorConfig
                      ) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, the worker's read-only mounts, init containers) for the pod's weights."""
    model = spec.model
    mount = {"mountPath": MODEL_DIR, "readOnly": True}
    if model.pvc is not None:
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": model.pvc.claim_name, "readOnly": True}}
        sub = {"subPath": model.pvc.sub_path} if model.pvc.sub_path else {}
        return [volume], [{"name": "model", **mount, **sub}], []
    if model.host_path is not None:
        volume = {"name": "model", "hostPath": {"path": model.host_path, "type": "Directory"}}
        return [volume], [{"name": "model", **mount}], []
    if model.image is not None:
        source = {"reference": model.image.reference}
        # Unset, the kubelet's default (IfNotPresent but for :latest) applies, unless the operator pulls
        # Always (its policy forces it in this namespace): an image on the node is then never used unchecked.
        pull = model.image.pull_policy or ("Always" if config.pull_policy == "Always" else None)
        if pull:
            source["pullPolicy"] = pull
        return ([{"name": "model", "image": source}],
                [{"name": "model", "mountPath": IMAGE_DIR, "readOnly": True}], [])
    if model.hub is None:
        return [], [], []
    cache = model.cache
    weights_mount = [{"name": "weights", "mountPath": WEIGHTS_DIR, "readOnly": True}]
    if cache is not None and cache.pvc is not None:
        volume = {"name": "weights", "persistentVolumeClaim": {"claimName": names(name)["weights"], "readOnly": True}}
        wait = _download_container("wait-for-weights", ["tandem", "model", "wait", "--dir", hub_folder(model)],
                                   spec, config, read_only=True)
        return [volume], weights_mount, [wait]
    if cache is not None and cache.host_path is not None:
        volume = {"name": "weights", "hostPath": {"path": cache.host_path.path, "type": "DirectoryOrCreate"}}
    else:
        limit = cache.empty_dir.size_limit if cache is not None and cache.empty_dir else DEFAULT_HUB_CACHE_LIMIT
        volume = {"name": "weights", "emptyDir": {"sizeLimit": limit}}
    fetch = _download_container(DOWNLOAD_INIT, _download_command(model), spec, config, read_only=False)
    return [volume], weights_mount, [fetch]


def router_model_dir(spec: InferenceServiceSpec) -> str | None:
    """The model folder as a router pod sees it (router_weights_parts), None where it cannot."""
    model = spec.model
    shared_cache = model.hub is not None and model.cache is not None and model.cache.pvc is not None
    return model_arg(spec) if model.pvc is not None or model.image is not None or shared_cache else None


def router_weights_parts(name: str, spec: InferenceServiceSpec, config: OperatorConfig,
                         wait_image: tuple[str, str]) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, read-only mounts, init containers) that let a router pod read the model's tokenizer
    files at router_model_dir: a claim (model.pvc, or a hub model's cache.pvc, waited for with
    `wait_image` until its Job filled it) or an image volume, which a Restricted pod may mount. Nothing
    for a path inside the worker image, a node's hostPath and a hub model each pod downloads itself."""
    model = spec.model
    if model.pvc is not None or model.image is not None:
        volumes, mounts, _ = weights_pod_parts(name, spec, config)
        return volumes, mounts, []
    if router_model_dir(spec) is None:
        return [], [], []
    volume = {"name": "weights", "persistentVolumeClaim": {"claimName": names(name)["weights"], "readOnly": True}}
    mount = {"name": "weights", "mountPath": WEIGHTS_DIR, "readOnly": True}
    image, pull = wait_image
    wait = {"name": "wait-for-weights", "image": image, "imagePullPolicy": pull,
            "command": ["tandem", "model", "wait", "--dir", hub_folder(model)],
            "volumeMounts": [mount], "securityContext": dict(RESTRICTED),
            "terminationMessagePolicy": "FallbackToLogsOnError"}
    return [volume], [mount], [wait]


def weights_children(meta: dict, spec: InferenceServiceSpec, config: OperatorConfig) -> list[Manifest]:
    """The shared cache's claim and its download Job (a hub model with cache.pvc), else nothing."""
    model = spec.model
    if model.hub is None or model.cache is None or model.cache.pvc is None:
        return []
    claim = model.cache.pvc
    name = names(meta["name"])["weights"]
    pvc_spec: dict[str, Any] = {"accessModes": [claim.access_mode],
                                "resources": {"requests": {"storage": claim.size}}}
    if claim.storage_class_name:
        pvc_spec["storageClassName"] = claim.storage_class_name
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": metadata(meta, name, "weights"), "spec": pvc_spec}
    return [pvc, download_job(meta, spec, config)]


def download_job_name(service: str, model: Model) -> str:
    """The download Job of a pinned hub model: one per commit. At most 63 characters (a Job's name
    is also a label value): a service name has at most 50."""
    return f"{service}-dl-{short_hash([model.hub, model.hub_revision], 8)}"


# Trying again cannot fix a gated repo or a missing one (`tandem model download` exits EXIT_PERMANENT):
# the Job fails at once, not after backoffLimit retries over ten minutes. A pod evicted or preempted
# (DisruptionTarget) does not count as an attempt.
POD_FAILURE_POLICY = {"rules": [
    {"action": "FailJob", "onExitCodes": {"containerName": "download", "operator": "In", "values": [EXIT_PERMANENT]}},
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
]}


def download_job(meta: dict, spec: InferenceServiceSpec, config: OperatorConfig) -> Manifest:
    """One Job per commit (its name carries the commit): it fills the shared claim once."""
    model = spec.model
    job_name = download_job_name(meta["name"], model)
    container = _download_container("download", _download_command(model), spec, config, read_only=False)
    container["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}}
    pod = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        # The claim's files belong to the image's user (uid 10001), who downloads and then reads them.
        "securityContext": {"runAsNonRoot": True, "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": names(meta["name"])["weights"]}}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(meta, job_name, "weights"),
        "spec": {"backoffLimit": 6, "podFailurePolicy": POD_FAILURE_POLICY, "template": {"metadata": {"labels": metadata(meta, job_name, "weights")["labels"]},
                                                 "spec": pod}},
    }
