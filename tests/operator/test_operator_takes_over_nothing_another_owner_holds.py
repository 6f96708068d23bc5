"""On the real control plane: an object that happens to carry a child's name is refused, not taken
over (issue 21.6), and a recreated internal Secret rolls the pods that read it (issue 21.8)."""

from __future__ import annotations

import pytest
from kubernetes import client
from tandem.operator.render.trust import ANNOTATION_SECRET_UID
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events
from tandem.testing.kube_nodes import POOL_LABEL

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")


@pytest.fixture(scope="module")
def operator(start_operator):
    return start_operator()


def create(api, namespace: str, name: str) -> None:
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"path": "/m"}, "prefill": dict(role), "decode": dict(role),
                     "kvTransfer": {"backend": "tcp"}}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)


def ready(api, namespace: str, name: str) -> dict:
    tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], namespace, GVP[2], name)
    return next((c for c in (tis.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})


def deployments(api, namespace: str, name: str) -> list:
    return client.AppsV1Api(api).list_namespaced_deployment(namespace, label_selector=f"tandem.dev/service={name}").items


def refused(api, namespace: str, name: str, what: str) -> dict:
    def found():
        c = ready(api, namespace, name)
        return c if c.get("reason") == "AdoptionRefused" and what in c.get("message", "") else None

    return wait_until(found, timeout=60, what=f"Ready=False AdoptionRefused naming {what}")


def test_a_config_map_of_someone_else_is_refused_and_left_as_it_was(api, operator, namespace):
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "held-config"}, "data": {"keep": "me"}})
    create(api, namespace, "held")
    c = refused(api, namespace, "held", "ConfigMap/held-config")
    assert c["status"] == "False" and "has no controller" in c["message"]
    wait_events(api, namespace, "held", lambda e: e.reason == "AdoptionRefused" and e.type == "Warning",
                "a Warning event AdoptionRefused")
    cm = core.read_namespaced_config_map("held-config", namespace)
    assert cm.data == {"keep": "me"} and not cm.metadata.owner_references, "the ConfigMap was taken over"
    assert not deployments(api, namespace, "held")

    core.delete_namespaced_config_map("held-config", namespace)  # the owner gives the name up
    wait_until(lambda: ready(api, namespace, "held").get("status") == "True", timeout=90, what="held Ready")
    mine = core.read_namespaced_config_map("held-config", namespace)
    assert mine.metadata.owner_references[0].name == "held" and "keep" not in (mine.data or {})


def test_an_internal_secret_the_operator_did_not_create_is_refused_not_reused(api, operator, namespace):
    core = client.CoreV1Api(api)
    core.create_namespaced_secret(namespace, {"metadata": {"name": "planted-internal"},
                                              "stringData": {"secret": "known-to-someone"}})
    create(api, namespace, "planted")
    refused(api, namespace, "planted", "Secret/planted-internal")
    assert not deployments(api, namespace, "planted"), "no pod may start with a secret someone else knows"

    core.delete_namespaced_secret("planted-internal", namespace)
    wait_until(lambda: ready(api, namespace, "planted").get("status") == "True", timeout=90, what="planted Ready")
    fresh = core.read_namespaced_secret("planted-internal", namespace)
    assert fresh.metadata.owner_references[0].name == "planted"


def test_a_recreated_internal_secret_rolls_the_pods_that_read_it(api, operator, namespace):
    core = client.CoreV1Api(api)
    create(api, namespace, "rolled")
    wait_until(lambda: ready(api, namespace, "rolled").get("status") == "True", timeout=90, what="rolled Ready")
    first = core.read_namespaced_secret("rolled-internal", namespace).metadata.uid
    templates = {d.metadata.name: d.spec.template.metadata.annotations for d in deployments(api, namespace, "rolled")}
    assert len(templates) == 3 and all(a[ANNOTATION_SECRET_UID] == first for a in templates.values())

    core.delete_namespaced_secret("rolled-internal", namespace)
    second = wait_until(lambda: core.read_namespaced_secret("rolled-internal", namespace).metadata.uid,
                        timeout=60, what="the internal Secret created again")
    assert second != first

    def rolled():
        pods = [p for p in core.list_namespaced_pod(namespace, label_selector="tandem.dev/service=rolled").items
                if not p.metadata.deletion_timestamp]
        return len(pods) == 3 and all((p.metadata.annotations or {}).get(ANNOTATION_SECRET_UID) == second
                                      for p in pods)

    wait_until(rolled, timeout=120, what="every pod of rolled replaced by one reading the new Secret")
    wait_until(lambda: ready(api, namespace, "rolled").get("status") == "True", timeout=90, what="rolled Ready again")
