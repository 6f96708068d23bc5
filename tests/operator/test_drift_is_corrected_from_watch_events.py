"""A child deleted or changed by hand is corrected from its watch event, not at the next resync (the
resync runs far less often at scale): on the real control plane, with a resync of 10 minutes. Every
kind the operator applies is watched (operator/watch.py): a Deployment, and the ConfigMap, the
NetworkPolicy and the router's Service and Role."""

from __future__ import annotations

import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events
from tandem.testing.kube_nodes import POOL_LABEL

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def create(api, namespace: str, name: str) -> None:
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
        "spec": {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role),
                 "kvTransfer": {"backend": "tcp"}}})


def test_a_deleted_or_scaled_deployment_comes_back_without_a_resync(k8s, api, start_operator, namespace):
    start_operator("--resync-seconds", "600")
    name = "evented"
    create(api, namespace, name)
    apps = client.AppsV1Api(api)
    first = wait_until(lambda: apps.read_namespaced_deployment(f"{name}-prefill", namespace), timeout=60,
                       what="the prefill Deployment").metadata.uid
    wait_until(lambda: apps.read_namespaced_deployment(f"{name}-decode", namespace), timeout=60,
               what="the decode Deployment")

    apps.delete_namespaced_deployment(f"{name}-prefill", namespace)
    k8s.kubectl("scale", "-n", namespace, f"deployment/{name}-decode", "--replicas=3")

    def restored():
        prefill = apps.read_namespaced_deployment(f"{name}-prefill", namespace)
        decode = apps.read_namespaced_deployment(f"{name}-decode", namespace)
        return prefill.metadata.uid != first and decode.spec.replicas == 1

    wait_until(restored, timeout=60, what="the prefill Deployment back and decode at 1 replica, long before a resync")
    wait_events(api, namespace, name, lambda e: e.reason == "DriftCorrected", "a DriftCorrected event")


def test_other_children_deleted_or_edited_come_back_without_a_resync(k8s, api, start_operator, namespace):
    start_operator("--resync-seconds", "600")
    name = "watched"
    create(api, namespace, name)
    core, net, rbac = client.CoreV1Api(api), client.NetworkingV1Api(api), client.RbacAuthorizationV1Api(api)
    reads = {
        "config": lambda: core.read_namespaced_config_map(f"{name}-config", namespace),
        "policy": lambda: net.read_namespaced_network_policy(f"{name}-workers", namespace),
        "service": lambda: core.read_namespaced_service(f"{name}-router", namespace),
        "role": lambda: rbac.read_namespaced_role(f"{name}-router", namespace),
    }
    first = {what: wait_until(read, timeout=60, what=what) for what, read in reads.items()}
    wait_events(api, namespace, name, lambda e: e.reason == "Created", "a Created event")

    core.delete_namespaced_config_map(f"{name}-config", namespace)
    net.delete_namespaced_network_policy(f"{name}-workers", namespace)
    rbac.delete_namespaced_role(f"{name}-router", namespace)
    component = "app.kubernetes.io/component"
    k8s.kubectl("label", "--overwrite", "-n", namespace, f"service/{name}-router", f"{component}=edited")

    def restored():
        back = {what: read() for what, read in reads.items()}
        recreated = all(back[w].metadata.uid != first[w].metadata.uid for w in ("config", "policy", "role"))
        return recreated and back["service"].metadata.labels[component] == first["service"].metadata.labels[component]

    wait_until(restored, timeout=60, what="the ConfigMap, NetworkPolicy and Role back and the Service's label")
    wait_events(api, namespace, name, lambda e: e.reason == "DriftCorrected", "a DriftCorrected event")
