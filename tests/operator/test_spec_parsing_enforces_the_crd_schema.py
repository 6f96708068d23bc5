"""InferenceServiceSpec.from_dict reads what the API server stores, fills the CRD's defaults, and
refuses what the CRD's OpenAPI schema refuses with a SpecError naming the field, never a crash.

The constraint cases are walked from the CRD file itself, so a constraint added to the schema
without the parser enforcing it fails here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from tandem.operator.spec import InferenceServiceSpec, SpecError

ROLE = {
    "replicas": 2, "gpus": 1, "cpu": "4", "memory": "64Gi", "shmSize": "8Gi",
    "parallelism": {"tensor": 2, "nodes": 2, "topologyKey": "example.com/rack"},
    "nodeSelector": {"pool": "p"},
    "tolerations": [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule",
                     "tolerationSeconds": 5}],
    "affinity": {"nodeAffinity": {}},
    "env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
    "engine": {"maxBatchedTokens": 8, "maxNumSeqs": 2, "kvBlocks": 10, "kvMemoryFraction": 0.5,
               "prefixCaching": False, "prefillChunkTokens": 4},
    "terminationGracePeriodSeconds": 30,
    "priorityClassName": "serving", "runtimeClassName": "nvidia", "imagePullSecrets": [{"name": "regcred"}],
    "serviceAccountName": "weights-reader",
    "podDisruptionBudget": {"enabled": True, "maxUnavailable": "25%", "minAvailable": 1},
}
# Every field set (CEL rules are the API server's, so all model sources at once parse here).
FULL = {
    "model": {"path": "/m", "hostPath": "/h", "pvc": {"claimName": "c", "subPath": "s"}, "hub": "org/m",
              "revision": "v1.0", "tokenSecretRef": {"name": "hf", "key": "token"},
              "cache": {"pvc": {"size": "10Gi", "storageClassName": "nfs", "accessMode": "ReadWriteMany"},
                        "hostPath": {"path": "/var/cache/tandem"}, "emptyDir": {"sizeLimit": "40Gi"}},
              "image": {"reference": "registry.io/models/llama:1", "pullPolicy": "IfNotPresent",
                        "path": "/models"},
              "dtype": "bfloat16", "maxModelLen": 2048, "servedName": "m"},
    "prefill": ROLE,
    "decode": copy.deepcopy(ROLE),  # its own copy: a case changes one role only
    "kvTransfer": {"backend": "nixl", "blockSize": 32,
                   "ucx": {"transports": "rc", "netDevices": "mlx5_0:1", "env": {"UCX_A": "1"}},
                   "rdma": {"resourceName": "rdma/ib", "count": 1}, "hostNetwork": True, "ipcLock": True,
                   "minBandwidthGBps": 5.0},
    "router": {"replicas": 1, "service": {"type": "NodePort", "port": 80}, "policy": "least-loaded", "firstToken": "with-decode",
               "flowControl": {"maxConcurrentRequests": 16, "bandCapacity": 8, "ttlSeconds": 5.0, "headroom": 2,
                               "objectives": {"interactive": 10}},
               "shortPromptTokens": 0, "prefillSaturatedTokens": 4096, "decodeHeadroomSequences": 8,
               "prefixSequenceCostTokens": 128, "limits": {"maxPromptTokens": 10, "maxOutputTokens": 10,
                                                  "maxRequestOutputTokens": 40, "maxRequestLogprobs": 400,
                                                  "maxBodyBytes": 2048},
               "apiKeySecretRef": {"name": "s", "key": "k"}, "cpu": 1, "memory": "1Gi",
               "priorityClassName": "serving", "runtimeClassName": "runc", "imagePullSecrets": [{"name": "r"}],
               "image": {"repository": "reg.io/router", "tag": "1.0", "pullPolicy": "Never"},
               "serviceAccountName": "router-sa", "podDisruptionBudget": {"enabled": False, "maxUnavailable": 2,
                                                                          "minAvailable": "50%"}},
    "image": {"repository": "reg.io/x", "tag": "1.0", "pullPolicy": "Always"},
    "runtime": {"name": "vllm", "image": {"repository": "reg.io/vllm", "tag": "1.0", "pullPolicy": "Always"},
                "args": ["--enforce-eager"]},
    "networkPolicy": {"enabled": False, "metricsFrom": [{"podSelector": {}}]},
    "gateway": {"enabled": False, "failureMode": "FailClose", "pickerReplicas": 2,
                "parentRefs": [{"name": "gw", "namespace": "infra", "sectionName": "http"}]},
    "autoscaling": {
        "intervalSeconds": 10, "windowSeconds": 30, "tolerance": 0.2,
        "targets": {"ttft": {"seconds": 1.5, "percentile": 95}, "itl": {"seconds": 0.05, "percentile": 99}},
        "prefill": {"mode": "Operator", "minReplicas": 0, "maxReplicas": 4, "targetUtilization": 0.7,
                    "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 2, "maxStepPercent": 50},
                    "scaleDown": {"stabilizationWindowSeconds": 60, "maxStep": 1, "maxStepPercent": 10}},
        "decode": {"mode": "External", "minReplicas": 1, "maxReplicas": 8,
                   "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 4, "maxStepPercent": 100},
                   "scaleDown": {"stabilizationWindowSeconds": 300, "maxStep": 1, "maxStepPercent": 20}},
    },
}

Path = tuple[str | int, ...]


def _walk(schema: dict, value: Any, path: Path = ()) -> Iterator[tuple[Path, dict, Any]]:
    """(path, schema, value) of every property below `schema`, following FULL's values."""
    for key, sub in (schema.get("properties") or {}).items():
        assert key in value, f"FULL lacks {'.'.join(map(str, path + (key,)))}: add it so it is tested"
        yield path + (key,), sub, value[key]
        yield from _walk(sub, value[key], path + (key,))
    if isinstance(schema.get("items"), dict):
        yield path + (0,), schema["items"], value[0]
        yield from _walk(schema["items"], value[0], path + (0,))
    if isinstance(schema.get("additionalProperties"), dict):
        key = next(iter(value))
        yield path + (key,), schema["additionalProperties"], value[key]


def _dotted(path: Path) -> str:
    return "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


WRONG_TYPE = {"string": 5, "integer": "5", "number": "x", "boolean": "yes", "object": "x", "array": {}}


def _breaking(schema: dict, value: Any) -> Iterator[tuple[str, Any]]:
    """(what, a value the schema refuses) per constraint the schema declares."""
    if schema.get("x-kubernetes-int-or-string"):
        yield "type", True
        yield "pattern", "lots"
    else:
        yield "type", WRONG_TYPE[schema["type"]]
    if "enum" in schema:
        yield "enum", "not-a-choice" if schema["type"] == "string" else 12345
    if "minimum" in schema:
        yield "minimum", schema["minimum"] if schema.get("exclusiveMinimum") else schema["minimum"] - 1
    if "maximum" in schema:
        yield "maximum", schema["maximum"] + 1
    if "maxLength" in schema:
        yield "maxLength", "a" * (schema["maxLength"] + 1)
    if "pattern" in schema and schema.get("type") == "string":
        yield "pattern", " "
    if "maxItems" in schema:
        yield "maxItems", [copy.deepcopy(value[0])] * (schema["maxItems"] + 1)
    if "maxProperties" in schema:
        yield "maxProperties", {f"UCX_{i}": "v" for i in range(schema["maxProperties"] + 1)}


def _cases(spec_schema: dict) -> list[tuple[str, Path, Any]]:
    return [(what, path, bad) for path, schema, value in _walk(spec_schema, FULL)
            for what, bad in _breaking(schema, value)]


def _set(spec: dict, path: Path, value: Any) -> dict:
    spec = copy.deepcopy(spec)
    node: Any = spec
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return spec


def test_a_spec_with_every_field_parses_and_round_trips(defaulted):
    parsed = InferenceServiceSpec.from_dict(copy.deepcopy(FULL))
    assert defaulted(FULL) == FULL, "every field is set"
    assert parsed.to_dict() == _set(FULL, ("router", "cpu"), "1")
    assert parsed.router.cpu == "1", "an integer quantity becomes the string a pod spec takes"
    assert parsed.prefill.tolerations[0].toleration_seconds == 5


def test_every_declared_constraint_is_enforced_naming_the_field(spec_schema):
    cases = _cases(spec_schema)
    assert len(cases) > 150, "the walk covers the whole schema"
    missed = []
    for what, path, bad in cases:
        try:
            InferenceServiceSpec.from_dict(_set(FULL, path, bad))
        except SpecError as e:
            if not e.path.startswith(_dotted(path)):
                missed.append(f"{_dotted(path)} ({what}): error names {e.path}")
        else:
            missed.append(f"{_dotted(path)} ({what}): {repr(bad)[:60]} was accepted")
    assert not missed, "\n".join(missed)


def test_missing_required_fields_and_non_objects_are_refused():
    for spec, path in [
        (None, "spec"), ([], "spec"), ({}, "spec.model"), ({"model": "/m"}, "spec.model"),
        ({"model": {"pvc": {"subPath": "x"}}}, "spec.model.pvc.claimName"),
        ({"model": {"path": "/m"}, "decode": {"env": [{"value": "x"}]}}, "spec.decode.env[0].name"),
        ({"model": {"path": "/m"}, "kvTransfer": {"rdma": {}}}, "spec.kvTransfer.rdma.resourceName"),
        ({"model": {"path": "/m"}, "prefill": {"tolerations": ["NoSchedule"]}}, "spec.prefill.tolerations[0]"),
        ({"model": {"path": "/m"}, "prefill": {"replicas": True}}, "spec.prefill.replicas"),
        ({"model": {"path": "/m"}, "prefill": {"gpus": 1.5}}, "spec.prefill.gpus"),
        ({"model": {"path": "/m"}, "decode": {"memory": 0.5}}, "spec.decode.memory"),
        ({"model": {"path": "/m"}, "decode": {"nodeSelector": {"pool": 3}}}, "spec.decode.nodeSelector.pool"),
    ]:
        with pytest.raises(SpecError) as err:
            InferenceServiceSpec.from_dict(spec)
        assert err.value.path == path, (spec, str(err.value))
        assert str(err.value).startswith(f"{path}: ")


def test_parsing_fills_the_defaults_the_crd_declares(examples, defaulted):
    raws = [e["spec"] for e in examples.values()] + [
        {"model": {"hub": "org/m"}},
        {"model": {"path": "/m"}, "router": {"apiKeySecretRef": {"name": "k"}}},
        {"model": {"path": "/m"}, "prefill": {"tolerations": [{"operator": "Exists"}]}},
    ]
    for raw in raws:
        assert InferenceServiceSpec.from_dict(copy.deepcopy(raw)).to_dict() == defaulted(raw)
        assert InferenceServiceSpec.from_dict(copy.deepcopy(raw)) == InferenceServiceSpec.from_dict(defaulted(raw))
    minimal = InferenceServiceSpec.from_dict({"model": {"path": "/m"}})
    assert minimal.prefill.termination_grace_period_seconds == 120, "prefill drains its KV leases"
    assert minimal.decode.termination_grace_period_seconds == 60
    assert minimal.router.api_key_secret_ref is None and minimal.image is None


def test_a_number_stays_the_number_the_cr_gave():
    """kvMemoryFraction: 1 must reach the config file as 1, not 1.0 (its hash rolls the pods)."""
    spec = InferenceServiceSpec.from_dict({"model": {"path": "/m"}, "decode": {"engine": {"kvMemoryFraction": 1}}})
    assert spec.decode.engine.kv_memory_fraction == 1 and isinstance(spec.decode.engine.kv_memory_fraction, int)
