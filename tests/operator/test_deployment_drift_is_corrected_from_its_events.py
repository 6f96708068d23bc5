"""A Deployment deleted or scaled by hand is corrected from its watch event, not at the next resync
(the resync runs far less often at scale): on the real control plane, with a resync of 10 minutes."""

from __future__ import annotations

import pytest
from kubernetes import client
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events
from tandem.testing.kube_nodes import POOL_LABEL

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


def test_a_deleted_or_scaled_deployment_comes_back_without_a_resync(k8s, api, start_operator, namespace):
    start_operator("--resync-seconds", "600")
    name = "evented"
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
        "spec": {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role),
                 "kvTransfer": {"backend": "tcp"}}})
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
