"""The real API server refuses malformed InferenceServices at create time, naming the field.

Runs against the control plane from the harness (etcd + kube-apiserver); nothing is mocked.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.operator.spec import InferenceServiceSpec

pytestmark = pytest.mark.cluster

BASE = {
    "model": {"path": "/models/m", "maxModelLen": 4096},
    "prefill": {"replicas": 1, "gpus": 1},
    "decode": {"replicas": 1, "gpus": 1},
}


def _with(path: str, value, base: dict | None = None) -> dict:
    """BASE with one dotted path set (value DELETE removes it)."""
    spec = copy.deepcopy(BASE if base is None else base)
    *parents, leaf = path.split(".")
    node = spec
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return spec


DELETE = object()
RDMA = {"resourceName": "rdma/ib", "count": 1}

# (id, spec, substrings the API server's message must contain: the field, and what is wrong)
INVALID = [
    ("no-model-source", _with("model.path", DELETE), ["spec.model", "exactly one of model.path"]),
    ("two-model-sources", _with("model.hub", "org/name"), ["spec.model", "exactly one of"]),
    ("model-missing", _with("model", DELETE), ["spec.model", "Required"]),
    ("relative-path", _with("model.path", "models/m"), ["spec.model.path"]),
    ("relative-host-path", _with("model", {"hostPath": "mnt/m"}), ["spec.model.hostPath"]),
    ("host-path-climbs-out", _with("model", {"hostPath": "/mnt/models/../../etc"}),
     ["spec.model.hostPath", "must be an absolute, normalised path"]),
    ("cache-host-path-not-normalised", _with("model", {"hub": "org/m", "cache": {"hostPath": {"path": "/var//cache/"}}}),
     ["spec.model.cache.hostPath.path", "must be an absolute, normalised path"]),
    ("bad-hub-id", _with("model", {"hub": "not a hub id!"}), ["spec.model.hub"]),
    ("pvc-without-claim", _with("model", {"pvc": {"subPath": "x"}}), ["spec.model.pvc.claimName", "Required"]),
    ("pvc-subpath-escapes", _with("model", {"pvc": {"claimName": "m", "subPath": "../etc"}}),
     ["spec.model.pvc", "model.pvc.subPath must be a relative path"]),
    ("unknown-dtype", _with("model.dtype", "int4"), ["spec.model.dtype", "Unsupported value"]),
    ("tiny-context", _with("model.maxModelLen", 8), ["spec.model.maxModelLen"]),
    ("negative-prefill-replicas", _with("prefill.replicas", -1), ["spec.prefill.replicas"]),
    ("negative-decode-gpus", _with("decode.gpus", -1), ["spec.decode.gpus"]),
    ("too-many-gpus", _with("decode.gpus", 17), ["spec.decode.gpus"]),
    ("memory-not-a-quantity", _with("prefill.memory", "lots"), ["spec.prefill.memory"]),
    ("kv-blocks-and-fraction", _with("prefill.engine", {"kvBlocks": 100, "kvMemoryFraction": 0.5}),
     ["spec.prefill.engine", "set kvBlocks or kvMemoryFraction, not both"]),
    ("kv-fraction-above-one", _with("decode.engine", {"kvMemoryFraction": 1.5}),
     ["spec.decode.engine.kvMemoryFraction"]),
    ("kv-fraction-zero", _with("decode.engine", {"kvMemoryFraction": 0}), ["spec.decode.engine.kvMemoryFraction"]),
    ("zero-max-num-seqs", _with("prefill.engine", {"maxNumSeqs": 0}), ["spec.prefill.engine.maxNumSeqs"]),
    ("unknown-kv-backend", _with("kvTransfer", {"backend": "rdma"}), ["spec.kvTransfer.backend", "Unsupported value"]),
    ("rdma-count-zero", _with("kvTransfer", {"rdma": {"resourceName": "rdma/ib", "count": 0}}),
     ["spec.kvTransfer.rdma", "kvTransfer.rdma.count must be greater than 0"]),
    ("rdma-bad-resource-name", _with("kvTransfer", {"rdma": {"resourceName": "infiniband please"}}),
     ["spec.kvTransfer.rdma.resourceName"]),
    ("host-network-without-rdma", _with("kvTransfer", {"hostNetwork": True}),
     ["spec.kvTransfer", "kvTransfer.hostNetwork is only allowed together with kvTransfer.rdma"]),
    ("tcp-with-rdma", _with("kvTransfer", {"backend": "tcp", "rdma": RDMA}),
     ["spec.kvTransfer", "kvTransfer.rdma needs kvTransfer.backend nixl"]),
    ("rdma-on-cpu-workers", _with("kvTransfer", {"rdma": RDMA}, _with("decode.gpus", 0)),
     ["spec", "kvTransfer.rdma needs GPU workers"]),
    ("ucx-env-not-ucx", _with("kvTransfer", {"ucx": {"env": {"LD_PRELOAD": "/evil.so"}}}),
     ["spec.kvTransfer.ucx.env", "keys must be UCX_* or NCCL_*"]),
    ("ucx-transports-garbage", _with("kvTransfer", {"ucx": {"transports": "rc x; rm"}}),
     ["spec.kvTransfer.ucx.transports"]),
    ("router-port-out-of-range", _with("router", {"service": {"port": 70000}}), ["spec.router.service.port"]),
    ("router-service-type", _with("router", {"service": {"type": "Ingress"}}),
     ["spec.router.service.type", "Unsupported value"]),
    ("negative-router-replicas", _with("router", {"replicas": -1}), ["spec.router.replicas"]),
    ("prompt-limit-above-context", _with("router", {"limits": {"maxPromptTokens": 4096}}),
     ["spec", "router.limits.maxPromptTokens must be below model.maxModelLen"]),
    ("output-limit-above-context", _with("router", {"limits": {"maxOutputTokens": 5000}}),
     ["spec", "router.limits.maxOutputTokens must be below model.maxModelLen"]),
    ("tiny-body-limit", _with("router", {"limits": {"maxBodyBytes": 10}}), ["spec.router.limits.maxBodyBytes"]),
    ("api-key-ref-without-name", _with("router", {"apiKeySecretRef": {"key": "k"}}),
     ["spec.router.apiKeySecretRef.name", "Required"]),
    ("unknown-pull-policy", _with("image", {"pullPolicy": "Sometimes"}), ["spec.image.pullPolicy"]),
    ("reserved-env", _with("prefill.env", [{"name": "POD_IP", "value": "1.2.3.4"}]),
     ["spec.prefill.env[0]", "set by the operator"]),
    ("internal-secret-in-env", _with("decode.env", [{"name": "TANDEM_INTERNAL_SECRET", "value": "x" * 20}]),
     ["spec.decode.env[0]", "set by the operator"]),
    ("network-policy-peer-not-an-object", _with("networkPolicy", {"metricsFrom": ["prometheus"]}),
     ["spec.networkPolicy.metricsFrom[0]"]),
    ("env-value-and-value-from", _with("decode.env", [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {}}}]),
     ["spec.decode.env[0]", "value or valueFrom, not both"]),
    ("priority-class-not-a-name", _with("decode.priorityClassName", "High Priority"),
     ["spec.decode.priorityClassName"]),
    ("runtime-class-not-a-name", _with("router", {"runtimeClassName": "NVIDIA!"}), ["spec.router.runtimeClassName"]),
    ("pull-secret-without-name", _with("prefill.imagePullSecrets", [{}]),
     ["spec.prefill.imagePullSecrets[0].name", "Required"]),
    ("service-account-not-a-name", _with("prefill.serviceAccountName", "a_b"), ["spec.prefill.serviceAccountName"]),
    ("budget-both-ways", _with("decode.podDisruptionBudget", {"maxUnavailable": 1, "minAvailable": 1}),
     ["spec.decode.podDisruptionBudget", "decode.podDisruptionBudget: set maxUnavailable or minAvailable"]),
    ("budget-above-100-percent", _with("router", {"podDisruptionBudget": {"maxUnavailable": "150%"}}),
     ["spec.router.podDisruptionBudget.maxUnavailable"]),
    ("budget-negative", _with("prefill.podDisruptionBudget", {"minAvailable": -1}),
     ["spec.prefill.podDisruptionBudget.minAvailable"]),
    ("duplicate-env-name", _with("decode.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
     ["spec.decode.env[1]", "Duplicate value"]),
    ("toleration-exists-with-value",
     _with("decode.tolerations", [{"key": "k", "operator": "Exists", "value": "v"}]),
     ["spec.decode.tolerations[0]", "operator Exists must not set value"]),
    ("toleration-bad-effect", _with("prefill.tolerations", [{"key": "k", "effect": "Sometimes"}]),
     ["spec.prefill.tolerations[0].effect"]),
    # Parallelism: the numbers are in the message (messageExpression), per role.
    ("gpus-not-tensor-over-nodes", _with("decode.parallelism", {"tensor": 8, "nodes": 2}),
     ["spec.decode", "decode.gpus is 1 but parallelism tensor 8 over 2 node(s) needs 4 GPUs per pod"]),
    ("tensor-not-a-multiple-of-nodes", _with("prefill.parallelism", {"tensor": 3, "nodes": 2}),
     ["spec.prefill.parallelism", "prefill.parallelism: tensor 3 is not a multiple of nodes 2"]),
    ("zero-tensor", _with("decode.parallelism", {"tensor": 0}), ["spec.decode.parallelism.tensor"]),
    ("too-many-nodes", _with("decode.parallelism", {"tensor": 32, "nodes": 17}),
     ["spec.decode.parallelism.nodes"]),
    ("topology-key-on-one-node", _with("decode.parallelism", {"topologyKey": "example.com/rack"}),
     ["spec.decode.parallelism", "topologyKey applies only to a group that spans nodes"]),
    # Weights delivery: a cache workers on several nodes can read, hub-only fields only with hub.
    ("cache-read-write-once", _with("model", {"hub": "org/m", "cache": {"pvc": {"size": "10Gi",
                                                                                "accessMode": "ReadWriteOnce"}}}),
     ["spec.model.cache.pvc", "accessMode must be ReadWriteMany", "ReadWriteOnce and ReadWriteOncePod mount on one"]),
    ("cache-read-only-many", _with("model", {"hub": "org/m", "cache": {"pvc": {"size": "10Gi",
                                                                               "accessMode": "ReadOnlyMany"}}}),
     ["spec.model.cache.pvc", "a ReadOnlyMany claim cannot be filled by the Job"]),
    ("cache-pvc-without-size", _with("model", {"hub": "org/m", "cache": {"pvc": {}}}),
     ["spec.model.cache.pvc.size", "Required"]),
    ("two-caches", _with("model", {"hub": "org/m", "cache": {"emptyDir": {"sizeLimit": "1Gi"},
                                                             "hostPath": {"path": "/c"}}}),
     ["spec.model.cache", "exactly one of pvc, hostPath or emptyDir"]),
    ("emptydir-cache-without-limit", _with("model", {"hub": "org/m", "cache": {"emptyDir": {}}}),
     ["spec.model.cache.emptyDir.sizeLimit", "Required"]),
    ("revision-without-hub", _with("model.revision", "main"),
     ["spec.model", "model.revision, model.tokenSecretRef and model.cache apply only to model.hub"]),
    ("cache-without-hub", _with("model.cache", {"emptyDir": {"sizeLimit": "1Gi"}}),
     ["spec.model", "apply only to model.hub"]),
    ("hub-and-image", _with("model", {"hub": "org/m", "image": {"reference": "r.io/m:1"}}),
     ["spec.model", "exactly one of model.path, model.hostPath, model.pvc, model.hub or model.image"]),
    ("image-not-a-reference", _with("model", {"image": {"reference": "not an image"}}),
     ["spec.model.image.reference"]),
    ("token-ref-without-name", _with("model", {"hub": "org/m", "tokenSecretRef": {"key": "token"}}),
     ["spec.model.tokenSecretRef.name", "Required"]),
    ("topology-key-not-a-label", _with("decode.parallelism", {"nodes": 1, "topologyKey": "a rack"}),
     ["spec.decode.parallelism.topologyKey"]),
]


def _body(name: str, spec: dict) -> dict:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}


def _create(api, namespace: str, body: dict, dry_run: bool = False) -> dict:
    kwargs = {"dry_run": "All"} if dry_run else {}
    return client.CustomObjectsApi(api).create_namespaced_custom_object(
        "tandem.dev", "v1alpha1", namespace, "inferenceservices", body, **kwargs
    )


def test_the_table_is_big_enough():
    assert len(INVALID) >= 20
    assert len({case[0] for case in INVALID}) == len(INVALID)


@pytest.fixture(scope="module")
def api(k8s, crd_installed):
    with k8s.api_client() as api:
        yield api


@pytest.mark.parametrize(("case", "spec", "expected"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_naming_the_field(api, namespace, case, spec, expected):
    with pytest.raises(ApiException) as err:
        _create(api, namespace, _body(case, spec))
    assert err.value.status == 422, err.value.body
    message = json.loads(err.value.body)["message"]
    for part in expected:
        assert part in message, f"{part!r} not in the API server's message: {message}"


def test_too_long_name_is_refused(api, namespace):
    with pytest.raises(ApiException) as err:
        _create(api, namespace, _body("a" * 51, BASE))
    message = json.loads(err.value.body)["message"]
    assert "metadata.name must be a DNS label of at most 50 characters" in message


def test_kubectl_apply_shows_the_message(k8s, crd_installed, namespace):
    bad = _body("bad", _with("kvTransfer", {"hostNetwork": True}))
    proc = k8s.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert proc.returncode != 0
    assert "kvTransfer.hostNetwork is only allowed together with kvTransfer.rdma" in proc.stderr


def test_examples_are_accepted(api, namespace, examples):
    assert set(examples) >= {"cpu", "gpu-roce", "gpu-ib-hostnetwork", "hub-shared-cache", "modelcar-image",
                             "gpu-multinode-groups"}
    for name, example in examples.items():
        body = copy.deepcopy(example)
        body["metadata"].pop("namespace", None)
        created = _create(api, namespace, body, dry_run=True)
        assert created["metadata"]["name"] == example["metadata"]["name"], name
        # what the API server stores, the operator reads back unchanged
        assert InferenceServiceSpec.from_dict(created["spec"]).to_dict() == created["spec"], name


def test_server_defaults_match_what_the_renderer_tests_assume(api, namespace, defaulted):
    """The unit tests default specs from the CRD file, and the operator's parser fills the same
    defaults from its declarations; the API server must agree with both."""
    for spec in (BASE, {"model": {"hub": "org/m"}}, {"model": {"path": "/m"}, "kvTransfer": {"rdma": RDMA}}):
        created = _create(api, namespace, _body("defaults", spec), dry_run=True)
        assert created["spec"] == defaulted(spec)
        assert InferenceServiceSpec.from_dict(copy.deepcopy(spec)).to_dict() == created["spec"]
    minimal = _create(api, namespace, _body("minimal", {"model": {"path": "/m"}}), dry_run=True)["spec"]
    assert minimal["prefill"]["replicas"] == 1 and minimal["decode"]["gpus"] == 1
    assert minimal["kvTransfer"]["backend"] == "nixl" and minimal["router"]["service"]["port"] == 8000
