"""The control-plane harness is real: the real scheduler places pods by extended resources
and node pools, KWOK runs them, the real garbage collector follows owner references, and
the TokenRequest API + RBAC authenticate and restrict a ServiceAccount."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from tandem.testing.cluster import wait_until
from tandem.testing.kube_nodes import GPU_TOLERATION, POOL_LABEL

pytestmark = pytest.mark.cluster


def _deployment(name: str, pool: str, gpus: int, rdma: int) -> dict:
    labels = {"app": name}
    resources = {"nvidia.com/gpu": str(gpus), "rdma/ib": str(rdma)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {POOL_LABEL: pool},
                    "tolerations": [GPU_TOLERATION],
                    "containers": [
                        {
                            "name": "worker",
                            "image": "tandem:test",
                            "resources": {"requests": resources, "limits": resources},
                        }
                    ],
                },
            },
        },
    }


def _pods(core: client.CoreV1Api, ns: str, selector: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(ns, label_selector=selector).items


def _running_ready(pod: client.V1Pod) -> bool:
    conds = {c.type: c.status for c in pod.status.conditions or []}
    return pod.status.phase == "Running" and conds.get("Ready") == "True"


def test_fake_gpu_nodes_are_ready_in_labelled_pools(k8s) -> None:
    with k8s.api_client() as api:
        nodes = client.CoreV1Api(api).list_node(label_selector=POOL_LABEL).items
    by_pool: dict[str, list[client.V1Node]] = {}
    for node in nodes:
        by_pool.setdefault(node.metadata.labels[POOL_LABEL], []).append(node)
    assert len(by_pool["prefill"]) >= 2 and len(by_pool["decode"]) >= 2
    for node in by_pool["prefill"] + by_pool["decode"]:
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.status.allocatable["rdma/ib"] == "4"
        assert node.status.capacity["rdma/rdma_shared_device_a"] == "4"
        assert any(t.key == "nvidia.com/gpu" and t.effect == "NoSchedule" for t in node.spec.taints)
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert ready and ready[0].status == "True"
    assert "nvidia.com/gpu" not in (by_pool["cpu"][0].status.allocatable or {})


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_gpu_deployment_is_scheduled_onto_its_pool_and_running(k8s, namespace, pool) -> None:
    with k8s.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        apps.create_namespaced_deployment(namespace, _deployment("w", pool, gpus=1, rdma=1))
        pods = wait_until(
            lambda: [p for p in _pods(core, namespace, "app=w") if _running_ready(p)],
            timeout=60,
            what="the Deployment's pod Running and Ready",
        )
        node = core.read_node(pods[0].spec.node_name)
        assert node.metadata.labels[POOL_LABEL] == pool
        # The Deployment controller saw it too: status flows back through the real controllers.
        wait_until(
            lambda: apps.read_namespaced_deployment("w", namespace).status.available_replicas == 1,
            timeout=60,
            what="Deployment availableReplicas=1",
        )


def test_pod_asking_more_gpus_than_any_node_has_stays_pending(k8s, namespace) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "too-big"},
        "spec": {
            "tolerations": [GPU_TOLERATION],
            "containers": [
                {
                    "name": "c",
                    "image": "tandem:test",
                    "resources": {"limits": {"nvidia.com/gpu": "9"}},
                }
            ],
        },
    }
    with k8s.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod(namespace, pod)

        def unschedulable() -> client.V1PodCondition | None:
            p = core.read_namespaced_pod("too-big", namespace)
            for c in p.status.conditions or []:
                if c.type == "PodScheduled" and c.status == "False":
                    return c
            return None

        cond = wait_until(unschedulable, timeout=60, what="the scheduler's verdict")
        assert cond.reason == "Unschedulable"
        assert "Insufficient nvidia.com/gpu" in cond.message
        current = core.read_namespaced_pod("too-big", namespace)
        assert current.status.phase == "Pending" and not current.spec.node_name


def test_deleting_a_deployment_garbage_collects_its_replicaset_and_pods(k8s, namespace) -> None:
    with k8s.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        apps.create_namespaced_deployment(namespace, _deployment("gc", "decode", gpus=2, rdma=1))
        wait_until(
            lambda: [p for p in _pods(core, namespace, "app=gc") if _running_ready(p)],
            timeout=60,
            what="the pod Running",
        )
        rs = apps.list_namespaced_replica_set(namespace, label_selector="app=gc").items
        assert len(rs) == 1 and rs[0].metadata.owner_references[0].kind == "Deployment"

        # Orphan-free background deletion: only the garbage collector removes the children.
        apps.delete_namespaced_deployment("gc", namespace, propagation_policy="Background")
        wait_until(
            lambda: (
                not apps.list_namespaced_replica_set(namespace, label_selector="app=gc").items
                and not _pods(core, namespace, "app=gc")
            ),
            timeout=60,
            what="ReplicaSet and Pods garbage-collected",
        )


def test_service_account_token_authenticates_with_its_rbac(k8s, namespace, tmp_path: Path) -> None:
    with k8s.api_client() as api:
        core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "op"}})
        token = core.create_namespaced_service_account_token(
            "op", namespace, {"spec": {"expirationSeconds": 600}}
        ).status.token
        rbac.create_namespaced_role(
            namespace,
            {
                "metadata": {"name": "read-pods"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
            },
        )
        rbac.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": "op-read-pods"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "read-pods",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": namespace}],
            },
        )

    kubeconfig = k8s.kubeconfig_for_token(token, tmp_path / "op.kubeconfig")
    whoami = k8s.kubectl(
        f"--kubeconfig={kubeconfig}", "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"
    )
    assert whoami.stdout == f"system:serviceaccount:{namespace}:op"

    from kubernetes import config

    with config.new_client_from_config(config_file=str(kubeconfig)) as sa_api:
        sa_core = client.CoreV1Api(sa_api)
        wait_until(
            lambda: sa_core.list_namespaced_pod(namespace) is not None,
            timeout=30,
            what="the RoleBinding to take effect",
        )
        with pytest.raises(ApiException) as denied:
            sa_core.list_node()
        assert denied.value.status == 403


def test_the_controller_managers_client_rate_is_its_default_unless_asked(tmp_path: Path) -> None:
    """The harness's kube-controller-manager keeps its default client rate (20/s, what bounds how
    fast it creates pods: bench operator_scale) unless a benchmark asks for another."""
    from tandem.testing.control_plane_config import controller_manager_argv

    def argv(qps):
        return controller_manager_argv(tmp_path, tmp_path, tmp_path / "kc", 1, tmp_path / "k", tmp_path / "ca", qps)

    assert not [a for a in argv(None) if a.startswith("--kube-api-")]
    assert {"--kube-api-qps=200", "--kube-api-burst=400"} <= set(argv(200))
