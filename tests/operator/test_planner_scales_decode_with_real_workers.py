"""The planner in the operator, on the real control plane, with real worker and router processes
standing in for the pods (KWOK gives them loopback IPs; each process listens at its pod's IP).

The operator runs with exactly the RBAC the Helm chart renders with autoscaling.markPodsForRemoval
on for the test's namespace (pods: patch there only), and --mark-pods-for-removal. Under load the planner
raises decode from 1 to 2 and status and an Event say why; when the load stops it lowers decode
again after the stabilisation window, and the pod the ReplicaSet removes is the one it chose; its
worker gets SIGTERM (ProcessGroup acts as the kubelet) and drains to a clean exit. Streams running
through such a scale-down: test_decode_scale_down_migrates_streams.py.
"""

from __future__ import annotations

import re
import threading

import openai
import pytest
from kubernetes import client
from tandem.operator.api_client import CHOSEN
from tandem.planning.autoscaling.planner import Reason
from tandem.testing.cluster import wait_until
from tandem.testing.k8s_events import wait_events
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_workers import ready_pods
from tandem.testing.rbac import rbac_denials

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.e2e]

GVP = ("tandem.dev", "v1alpha1", "inferenceservices")
STREAMS = 4
# A target no step on any machine meets (10 us), so the load keeps decode at 2 until it stops. With a
# target near the toy model's step (2 ms, as before), a quiet machine's two decode pods could be within
# it, and the planner then rightly learns more seats per pod and lowers decode while the load still runs.
ITL_TARGET_S = 0.00001
UP = {r.value for r in (Reason.QUEUE_BUILDING, Reason.ITL_ABOVE_TARGET, Reason.KV_SATURATED)}


def spec(model: str) -> dict:
    role = {"replicas": 1, "gpus": 0, "cpu": "100m", "memory": "1Gi", "nodeSelector": {POOL_LABEL: "cpu"}}
    return {
        "model": {"path": model, "dtype": "float32", "maxModelLen": 512},
        "prefill": dict(role), "decode": dict(role),
        "kvTransfer": {"backend": "tcp"},
        "router": {"cpu": "50m", "memory": "128Mi"},
        # The shortest windows the CRD allows: a decision every 5 s over 10 s of metrics. Scale-down
        # waits 40 s of lower recommendations: on a loaded 2-core machine (a second suite beside this
        # one) the 4 streams can stall for a window, and 10 s once lowered decode under load (seen
        # on a fresh clone, twice in all).
        "autoscaling": {"intervalSeconds": 5, "windowSeconds": 10, "targets": {"itl": {"seconds": ITL_TARGET_S}},
                        "decode": {"minReplicas": 1, "maxReplicas": 2,
                                   "scaleDown": {"stabilizationWindowSeconds": 40}}},
    }


def status(api, ns: str, name: str) -> dict:
    tis = client.CustomObjectsApi(api).get_namespaced_custom_object(*GVP[:2], ns, GVP[2], name)
    return tis.get("status") or {}


def posted(api, ns: str, name: str, reason: str) -> list:
    """The events of that reason, once there is one (posted after the status they go with)."""
    return wait_events(api, ns, name, lambda e: e.reason == reason, f"a {reason} event")


def table(text: str) -> dict[str, str]:
    """kubectl's one-row table by column name (a column may be empty: cut at the header's offsets)."""
    header, row = text.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    ends = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}


class Load:
    """STREAMS chat streams at a time, each started again as it ends, until stop()."""

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id
        self.done = threading.Event()
        self.errors: list[str] = []
        self.finished = 0
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        while not self.done.is_set():
            try:
                stream = self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "Count the sheep, slowly."}],
                    max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True})
                for _ in stream:
                    pass
                self.finished += 1
            except Exception as e:  # every failure is reported by stop()
                self.errors.append(repr(e))

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a load stream did not end within 120 s"


def test_load_raises_decode_and_idle_lowers_it_removing_the_pod_the_planner_chose(
    k8s, api, start_operator, chart_rbac, namespace, procs, toy_model_dir
):
    kubeconfig = chart_rbac(**{"autoscaling.markPodsForRemoval.enabled": True,
                               "autoscaling.markPodsForRemoval.namespaces": [namespace]}).kubeconfig
    operator = start_operator("--mark-pods-for-removal", kubeconfig=kubeconfig)
    name = "auto"
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": spec(str(toy_model_dir))}
    client.CustomObjectsApi(api).create_namespaced_custom_object(*GVP[:2], namespace, GVP[2], body)
    procs.follow_deletions(namespace)
    pods = {role: wait_until(lambda r=role: ready_pods(api, namespace, name, r) or None, timeout=60,
                             what=f"a Ready {role} pod")[0] for role in ("prefill", "decode", "router")}
    workers = [procs.worker_for_pod(pods[role], toy_model_dir) for role in ("prefill", "decode")]
    procs.wait_ready(workers)
    router = procs.router_for_pod(pods["router"], k8s.kubeconfig)
    procs.wait_ready([router])

    load = Load(router.url)
    try:
        def scaled_up():
            s = status(api, namespace, name)
            return s if (s.get("decode") or {}).get("replicas") == 2 else None

        try:
            up = wait_until(scaled_up, timeout=120, what="the planner raising decode to 2")
        except TimeoutError:
            raise AssertionError(f"decode was not raised; status: {status(api, namespace, name)}\n"
                                 f"{operator.log()[-3000:]}") from None
        assert up["decode"]["mode"] == "Operator" and up["decode"]["lastScaleTime"], up["decode"]
        cond = next(c for c in up["conditions"] if c["type"] == "Autoscaling")
        assert cond["status"] == "True" and cond["reason"] in ("Active", "LimitedByMax"), cond
        # The decision itself, as the event recorded it: status may have moved on by the time it is
        # read (a decision every 5 s: at 2 it says AtMaxReplicas), the event keeps what raised it.
        (event,) = posted(api, namespace, name, "ScaledUp")
        message, _, reason = event.message.rpartition(" [")
        assert message.startswith("decode 1 -> 2: ") and reason.rstrip("]") in UP, event.message
        assert up["decode"]["reason"] in UP | {Reason.AT_MAX.value}, up["decode"]
        if up["decode"]["message"].startswith("1 -> 2: "):  # read before the next decision: the same words
            assert event.message == f"decode {up['decode']['message']} [{up['decode']['reason']}]"

        # The printer columns show status as it is (the planner may have moved on since `up`: a decision
        # every 5 s), so they are compared with status read just before and just after.
        before = status(api, namespace, name)["decode"]
        wide = k8s.kubectl("get", "tis", name, "-n", namespace, "-o", "wide").stdout
        after = status(api, namespace, name)["decode"]
        columns = table(wide)
        assert columns["DECODE-DESIRED"] == "2", wide
        assert columns["DECODE-SCALING"] in (before["reason"], after["reason"]), wide
        assert columns["PREFILL-SCALING"] == "", "prefill is not autoscaled"

        # The second decode pod gets its worker; the router finds it and shares the load with it.
        first = pods["decode"]["metadata"]["name"]
        second = wait_until(lambda: [p for p in ready_pods(api, namespace, name, "decode")
                                     if p["metadata"]["name"] != first] or None,
                            timeout=60, what="the second decode pod")[0]
        procs.wait_ready([procs.worker_for_pod(second, toy_model_dir)])

        # A restarted operator keeps the planner's count: it lives in status, and reconcile reads it.
        held = status(api, namespace, name)["decode"]
        assert held["replicas"] == 2, f"the planner lowered decode under load: {held}"
        operator.stop()
        operator = start_operator("--mark-pods-for-removal", kubeconfig=kubeconfig)
        wait_until(lambda: f"{namespace}/{name}: generation" in operator.log(), timeout=60,
                   what="the restarted operator's first reconcile")
        kept = status(api, namespace, name)
        assert kept["decode"]["replicas"] == 2, f"{kept['decode']}\n{operator.log()[-3000:]}"
        apps = client.AppsV1Api(api)
        assert apps.read_namespaced_deployment(f"{name}-decode", namespace).spec.replicas == 2
    finally:
        load.stop()
    assert not load.errors, load.errors[:5]
    assert load.finished > 0

    def scaled_down():
        s = status(api, namespace, name)
        return s if (s.get("decode") or {}).get("replicas") == 1 else None

    try:
        down = wait_until(scaled_down, timeout=180, what="the planner lowering decode to 1")
    except TimeoutError:
        raise AssertionError(f"decode was not lowered; status: {status(api, namespace, name)}\n"
                             f"{operator.log()[-3000:]}") from None
    assert down["decode"]["reason"] in (Reason.IDLE.value, Reason.LOAD_DROPPED.value), down["decode"]
    (event,) = posted(api, namespace, name, "ScaledDown")
    chosen = re.search(r"; removing (\S+)", event.message)
    assert chosen and chosen.group(1) in (first, second["metadata"]["name"]), event.message
    left = wait_until(lambda: len(p := ready_pods(api, namespace, name, "decode")) == 1 and p, timeout=30,
                      what="one decode pod left")
    assert left[0]["metadata"]["name"] != chosen.group(1), "the ReplicaSet removed the pod the planner chose"
    assert CHOSEN not in (left[0]["metadata"].get("annotations") or {})
    gone = next(c for c in procs.children if c.name == chosen.group(1))
    assert gone.proc.wait(60) == 0 and procs.terminated == [chosen.group(1)], gone.log()[-3000:]
    assert not rbac_denials(operator.log()), "the chart's RBAC lacks what the autoscaler does"
