"""`tandem operator` turns an InferenceService into running workloads on the real control plane.

etcd + kube-apiserver + controller-manager (Deployments, garbage collector) + scheduler + KWOK
fake GPU/RDMA nodes in the pools tandem.dev/pool=prefill|decode|cpu. The operator runs as a
real subprocess; one per module, restarted once to prove it creates no duplicates.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events
from tandem.testing.kube_nodes import GPU_TOLERATION, POOL_LABEL

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
WORKER_CPU = "100m"
# A spec below moves to another image of the test registry: the operator's policy must allow it.
POLICY = ("--policy", json.dumps({"default": {"images": ["registry.test/"]}}))


def gpu_spec(prefill: int = 1, decode: int = 1, **kv) -> dict:
    """Prefill on the prefill pool, decode on the decode pool; both tolerate the GPU taint."""

    def role(replicas: int, pool: str) -> dict:
        return {
            "replicas": replicas, "gpus": 1, "cpu": WORKER_CPU, "memory": "1Gi",
            "nodeSelector": {POOL_LABEL: pool}, "tolerations": [dict(GPU_TOLERATION)],
        }

    return {
        "model": {"path": "/models/tiny", "maxModelLen": 2048},
        "prefill": role(prefill, "prefill"),
        "decode": role(decode, "decode"),
        "kvTransfer": {"backend": "nixl", **kv},
        "router": {"cpu": "50m", "memory": "128Mi"},
    }


def body(name: str, spec: dict) -> dict:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def operator(start_operator):
    return start_operator(*POLICY)


def get_tis(api, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], ns, GVP[2], name)


def condition(tis: dict, type_: str) -> dict:
    return next((c for c in (tis.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def children(api, ns: str, name: str) -> dict[str, list[str]]:
    sel = f"tandem.dev/service={name}"
    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    return {
        "Deployment": sorted(d.metadata.name for d in apps.list_namespaced_deployment(ns, label_selector=sel).items),
        "Service": sorted(s.metadata.name for s in core.list_namespaced_service(ns, label_selector=sel).items),
        "ConfigMap": sorted(c.metadata.name for c in core.list_namespaced_config_map(ns, label_selector=sel).items),
        "ServiceAccount": sorted(
            s.metadata.name for s in core.list_namespaced_service_account(ns, label_selector=sel).items),
        "Role": sorted(r.metadata.name for r in rbac.list_namespaced_role(ns, label_selector=sel).items),
        "RoleBinding": sorted(r.metadata.name for r in rbac.list_namespaced_role_binding(ns, label_selector=sel).items),
    }


def expected_children(name: str) -> dict[str, list[str]]:
    return {
        "Deployment": sorted(f"{name}-{r}" for r in ("prefill", "decode", "router")),
        "Service": sorted(f"{name}-{r}" for r in ("prefill", "decode", "router")),
        "ConfigMap": [f"{name}-config"],
        "ServiceAccount": [f"{name}-router"],
        "Role": [f"{name}-router"],
        "RoleBinding": [f"{name}-router"],
    }


def pods(api, ns: str, name: str, role: str) -> list:
    sel = f"tandem.dev/service={name},tandem.dev/role={role}"
    return [p for p in client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=sel).items
            if not p.metadata.deletion_timestamp]


def apply_tis(k8s, ns: str, manifest: dict) -> None:
    k8s.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(manifest))


def wait_ready(api, ns: str, name: str, timeout: float = 90, summary: str | None = None) -> dict:
    """Until Ready=True for the current spec (observedGeneration caught up), optionally with
    every role's ready/desired equal to `summary`."""

    def ready():
        tis = get_tis(api, ns, name)
        st = tis.get("status") or {}
        ok = (condition(tis, "Ready").get("status") == "True"
              and st.get("observedGeneration") == tis["metadata"]["generation"])
        if summary is not None:
            ok = ok and all(st.get(r, {}).get("summary") == summary for r in ("prefill", "decode"))
        return tis if ok else None

    try:
        return wait_until(ready, timeout=timeout, what=f"{name} Ready=True")
    except TimeoutError as e:
        tis = get_tis(api, ns, name)
        raise AssertionError(f"{e}; status: {json.dumps(tis.get('status'), indent=1)}") from None


def test_apply_creates_children_placed_on_their_pools_and_reports_ready(k8s, api, operator, namespace):
    name = "llama"
    t0 = time.monotonic()
    apply_tis(k8s, namespace, body(name, gpu_spec(prefill=2, decode=2)))
    wait_until(lambda: children(api, namespace, name) == expected_children(name), timeout=60,
               what="all children of llama", interval=0.05)
    elapsed = time.monotonic() - t0
    print(f"\nkubectl apply -> all {sum(map(len, expected_children(name).values()))} children created: {elapsed:.2f}s")

    tis = wait_ready(api, namespace, name, summary="2/2")
    # the real scheduler placed each role on its pool
    for role, pool in (("prefill", "prefill"), ("decode", "decode"), ("router", "cpu")):
        placed = pods(api, namespace, name, role)
        assert placed, role
        for p in placed:
            assert p.spec.node_name and p.spec.node_name.startswith(f"{pool}-"), (role, p.spec.node_name)
            assert p.status.phase == "Running"
    # prefill replicas spread over the two prefill nodes
    assert len({p.spec.node_name for p in pods(api, namespace, name, "prefill")}) == 2

    status = tis["status"]
    for type_ in ("Ready", "PrefillReady", "DecodeReady", "RouterReady"):
        c = condition(tis, type_)
        assert c["status"] == "True", c
        assert c["reason"] and c["message"] and c["lastTransitionTime"]
    assert condition(tis, "KVTransferReady")["status"] == "Unknown"
    assert status["observedGeneration"] == tis["metadata"]["generation"]
    assert status["endpoint"] == f"http://{name}-router.{namespace}.svc.cluster.local:8000"
    assert status["prefill"]["summary"] == "2/2" and status["decode"]["summary"] == "2/2"
    assert "finalizers" not in tis["metadata"], "no finalizer: deletion never waits for the operator"

    out = k8s.kubectl("get", "tis", "-n", namespace, name).stdout
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "READY", "PREFILL", "DECODE", "ENDPOINT", "AGE"]
    assert row.split()[:5] == [name, "True", "2/2", "2/2", status["endpoint"]]

    wait_events(api, namespace, name, lambda e: e.reason == "Created" and "Deployment/llama-prefill" in e.message,
                "a Created event naming Deployment/llama-prefill", kind="InferenceService")


def test_not_enough_gpus_or_rdma_is_reported_with_a_reason(k8s, api, operator, namespace):
    # 4 rdma/ib per GPU node in the harness: 5 per pod fits nowhere.
    apply_tis(k8s, namespace, body("no-rdma", gpu_spec(rdma={"resourceName": "rdma/ib", "count": 5})))
    # 8 GPUs per node: a prefill pod asking for 9 (one per rank of a tensor-parallel group) fits nowhere.
    spec = gpu_spec()
    spec["prefill"] |= {"gpus": 9, "parallelism": {"tensor": 9}}
    apply_tis(k8s, namespace, body("no-gpu", spec))

    def unschedulable(name: str, role_condition: str, resource: str):
        tis = get_tis(api, namespace, name)
        c = condition(tis, role_condition)
        return c if c.get("reason") == "Unschedulable" and resource in c.get("message", "") else None

    c = wait_until(lambda: unschedulable("no-gpu", "PrefillReady", "nvidia.com/gpu"), timeout=60,
                   what="no-gpu PrefillReady=Unschedulable")
    assert c["status"] == "False" and "Insufficient nvidia.com/gpu" in c["message"]
    assert condition(get_tis(api, namespace, "no-gpu"), "Ready")["reason"] == "Unschedulable"
    c = wait_until(lambda: unschedulable("no-rdma", "DecodeReady", "rdma/ib"), timeout=60,
                   what="no-rdma DecodeReady=Unschedulable")
    assert "Insufficient rdma/ib" in c["message"]


def test_updates_roll_through_to_the_children(k8s, api, operator, namespace):
    name = "upd"
    apply_tis(k8s, namespace, body(name, gpu_spec()))
    wait_ready(api, namespace, name)
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    before = apps.read_namespaced_deployment(f"{name}-decode", namespace)
    old_hash = before.spec.template.metadata.annotations["tandem.dev/config-hash"]

    spec = gpu_spec(decode=2)
    spec["image"] = {"repository": "registry.test/other", "tag": "v2"}
    spec["decode"]["engine"] = {"maxNumSeqs": 7}
    apply_tis(k8s, namespace, body(name, spec))

    def updated():
        d = apps.read_namespaced_deployment(f"{name}-decode", namespace)
        cm = core.read_namespaced_config_map(f"{name}-config", namespace)
        return (d.spec.replicas == 2
                and d.spec.template.spec.containers[0].image == "registry.test/other:v2"
                and yaml.safe_load(cm.data["decode.yaml"])["max_num_seqs"] == 7
                and d.spec.template.metadata.annotations["tandem.dev/config-hash"] != old_hash)

    wait_until(updated, timeout=60, what="decode Deployment and ConfigMap updated")
    tis = get_tis(api, namespace, name)
    assert tis["metadata"]["generation"] == 2

    def rolled():
        t = get_tis(api, namespace, name)
        gens = {p.metadata.labels["tandem.dev/kv-compat"] for role in ("prefill", "decode")
                for p in pods(api, namespace, name, role)}
        decode = pods(api, namespace, name, "decode")
        return (t["status"].get("decode", {}).get("summary") == "2/2"
                and t["status"].get("observedGeneration") == 2
                and gens == {t["status"]["kvCompat"]} and len(decode) == 2
                and all(p.spec.containers[0].image == "registry.test/other:v2" for p in decode))

    # prefill and decode pods all move to the new kv-compat (the image is part of it)
    wait_until(rolled, timeout=90, what="upd rolled out to the new kv-compat")
    assert wait_ready(api, namespace, name)


def test_drift_is_corrected(k8s, api, operator, namespace):
    name = "drift"
    apply_tis(k8s, namespace, body(name, gpu_spec()))
    wait_ready(api, namespace, name)
    apps = client.AppsV1Api(api)

    uid = apps.read_namespaced_deployment(f"{name}-prefill", namespace).metadata.uid
    apps.delete_namespaced_deployment(f"{name}-prefill", namespace)
    k8s.kubectl("scale", "-n", namespace, f"deployment/{name}-decode", "--replicas=3")
    client.CoreV1Api(api).delete_namespaced_config_map(f"{name}-config", namespace)
    client.CoreV1Api(api).delete_namespaced_service(f"{name}-router", namespace)

    def restored():
        d = apps.read_namespaced_deployment(f"{name}-prefill", namespace)
        decode = apps.read_namespaced_deployment(f"{name}-decode", namespace)
        client.CoreV1Api(api).read_namespaced_config_map(f"{name}-config", namespace)
        client.CoreV1Api(api).read_namespaced_service(f"{name}-router", namespace)
        return d.metadata.uid != uid and decode.spec.replicas == 1

    wait_until(restored, timeout=60, what="deleted Deployment, ConfigMap and Service back, replicas restored")
    wait_ready(api, namespace, name)
    wait_events(api, namespace, name, lambda e: e.reason == "DriftCorrected", "a DriftCorrected event")


def test_a_child_the_api_server_refuses_is_a_condition_not_a_crash(k8s, api, operator, namespace):
    """The CRD passes affinity through as is; the Deployment's own validation refuses this one."""
    name = "bad-affinity"
    spec = gpu_spec()
    spec["decode"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": []}}}
    apply_tis(k8s, namespace, body(name, spec))

    def apply_failed():
        c = condition(get_tis(api, namespace, name), "Ready")
        return c if c.get("reason") == "ApplyFailed" else None

    c = wait_until(apply_failed, timeout=60, what="Ready=False ApplyFailed")
    assert c["status"] == "False"
    assert f"Deployment/{name}-decode" in c["message"] and "nodeSelectorTerms" in c["message"]
    wait_events(api, namespace, name, lambda e: e.reason == "ApplyFailed" and e.type == "Warning",
                "a Warning event ApplyFailed")
    assert operator.proc.poll() is None, "the operator keeps running"

    apply_tis(k8s, namespace, body(name, gpu_spec()))  # fixed by the user
    wait_ready(api, namespace, name)


def test_operator_restart_creates_no_duplicates_and_deletion_cascades(k8s, api, operator, start_operator, namespace):
    name = "restart"
    apply_tis(k8s, namespace, body(name, gpu_spec()))
    wait_ready(api, namespace, name)
    apps = client.AppsV1Api(api)
    sel = f"tandem.dev/service={name}"

    def snapshot():
        rs = apps.list_namespaced_replica_set(namespace, label_selector=sel).items
        return (children(api, namespace, name), sorted(r.metadata.name for r in rs),
                {d.metadata.name: d.metadata.uid
                 for d in apps.list_namespaced_deployment(namespace, label_selector=sel).items})

    before = snapshot()
    operator.stop()
    assert operator.proc.returncode is not None
    again = start_operator(*POLICY)
    time.sleep(5)  # resume handler plus two resync passes of the new operator
    assert again.proc.poll() is None
    assert snapshot() == before, "a restart neither duplicates, re-creates nor rolls anything"
    assert len(pods(api, namespace, name, "prefill")) == 1

    # JSON logs on request: every line the operator printed is one JSON object
    lines = [line for line in again.log().splitlines() if line.strip()]
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)

    client.CustomObjectsApi(api).delete_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)

    def gone():
        return not any(children(api, namespace, name).values()) and not any(
            pods(api, namespace, name, r) for r in ("prefill", "decode", "router"))

    wait_until(gone, timeout=60, what="children garbage-collected after the CR was deleted")
    with pytest.raises(ApiException) as err:
        get_tis(api, namespace, name)
    assert err.value.status == 404
