"""The install flow a platform engineer follows, on the real control plane: `helm install`,
the operator running with nothing but the chart's RBAC, `kubectl apply` of the GPU/RoCE
example, Ready with an endpoint, then `helm uninstall` and what it leaves behind.

The operator runs as a local process (KWOK runs no containers) authenticated with a token
of the chart's ServiceAccount from the TokenRequest API, so a permission missing from the
chart's RBAC fails the test: either a step never completes or the operator's log shows a
403, which is checked at the end.

The CRD may already exist: other tests in the session apply crds/ directly (the same file),
and Helm installs a chart's crds/ only when absent. When no InferenceService exists anywhere
the test deletes that CRD first, so that `helm install` must register it; otherwise (a
leftover object from elsewhere) it leaves it and checks that the registered CRD is the
chart's. Either way the CRD is there afterwards, as `helm uninstall` leaves it, so tests
that expect it find it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tandem.testing.chart import CHART_DIR, REPO_ROOT, find, render
from tandem.testing.cluster import free_port, wait_until
from tandem.testing.kube_nodes import POOL_LABEL
from tandem.testing.pod_security import restricted_violations
from tandem.testing.rbac import rbac_denials

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RELEASE = "tandem-e2e"
CRD_NAME = "inferenceservices.tandem.dev"
EXAMPLE = REPO_ROOT / "examples" / "gpu-roce.yaml"
PSA = "pod-security.kubernetes.io/enforce"


def kubectl_json(k8s, *args: str) -> Any:
    return json.loads(k8s.kubectl(*args, "-o", "json").stdout)


def condition(obj: dict, type_: str) -> dict:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return cond
    return {}


@contextlib.contextmanager
def scratch_namespace(k8s, name: str, level: str) -> Iterator[str]:
    """A namespace at a Pod Security level, deleted afterwards."""
    k8s.kubectl("create", "namespace", name)
    try:
        k8s.kubectl("label", "namespace", name, f"{PSA}={level}", "tandem.dev/test=true")
        wait_until(
            lambda: k8s.kubectl("-n", name, "get", "serviceaccount", "default", check=False)
            .returncode == 0,
            timeout=60, what=f"ServiceAccount {name}/default",
        )
        yield name
    finally:
        k8s.kubectl("delete", "namespace", name, "--wait=false", check=False)


@contextlib.contextmanager
def operator_process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """`tandem operator ARGS` in its own process group; always stopped (TERM, then KILL)."""
    tandem = Path(sys.executable).parent / "tandem"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(tandem), *args], stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, cwd=log.parent,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=3) as resp:
        return resp.status == 200


def dry_run_pod(k8s, namespace: str, template: dict, name: str) -> subprocess.CompletedProcess:
    """Has the API server admit (not store) a pod built from a pod template: the real
    PodSecurity admission plugin judges it against the namespace's level."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"tandem.dev/dry-run": "true"}},
        "spec": template["spec"],
    }
    return k8s.kubectl("-n", namespace, "create", "--dry-run=server", "-f", "-",
                       input=json.dumps(pod), check=False)


def model_volume(k8s, namespace: str, claim: str) -> str:
    """A PersistentVolume bound to the claim the example mounts (the model weights): the real
    scheduler does not place a pod whose claim is missing or unbound. Returns the PV name."""
    pv = f"{namespace}-{claim}"
    k8s.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": pv, "labels": {"tandem.dev/test": "true"}},
        "spec": {
            "capacity": {"storage": "100Gi"},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": "/models"},
            "claimRef": {"namespace": namespace, "name": claim},
        },
    }))
    k8s.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": pv,
            "resources": {"requests": {"storage": "100Gi"}},
        },
    }))
    wait_until(
        lambda: kubectl_json(k8s, "-n", namespace, "get", "pvc", claim)["status"].get("phase")
        == "Bound",
        timeout=60, what=f"PVC {namespace}/{claim} Bound",
    )
    return pv


@pytest.mark.parametrize("watch", ["all-namespaces", "one-namespace"])
def test_helm_install_then_apply_an_example_serves_it_and_uninstall_cleans_up(
    k8s, namespace: str, tmp_path: Path, watch: str
) -> None:
    """watch=all-namespaces: the default install (ClusterRole). one-namespace:
    `watchNamespaces` set to the model's namespace (a Role there, kopf's namespace discovery
    cluster-wide)."""
    ops = namespace  # the operator's namespace: Restricted, enforced by the API server
    k8s.kubectl("label", "namespace", ops, f"{PSA}=restricted", "--overwrite")
    namespaces = contextlib.ExitStack()
    crd_existed = k8s.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0
    if crd_existed and not kubectl_json(k8s, "get", "tis", "-A")["items"]:
        k8s.kubectl("delete", "crd", CRD_NAME, "--timeout=60s")
        crd_existed = False
    installed = False
    pv = None
    operator_log = tmp_path / "operator.log"
    try:
        # The model's namespace, privileged: the example's RDMA workers add IPC_LOCK.
        llm = namespaces.enter_context(scratch_namespace(k8s, f"{ops}-llm", "privileged"))
        # -- 1. helm install: the CRD and the RBAC objects are registered ------------------
        values = ["--set-json", f'watchNamespaces=["{llm}"]'] if watch == "one-namespace" else []
        # The operator's policy allows what the example asks of the node there (docs/install.md).
        values += ["--set-json", f'policy.namespaces={{"{llm}": {{"ipcLock": true}}}}']
        install = k8s.helm("install", RELEASE, str(CHART_DIR), "--namespace", ops, *values,
                           "--wait", "--timeout", "180s")
        installed = True
        assert "STATUS: deployed" in install.stdout
        assert "kubectl -n llm apply -f examples/gpu-roce.yaml" in install.stdout  # NOTES.txt

        crd = kubectl_json(k8s, "get", "crd", CRD_NAME)
        assert condition(crd, "Established").get("status") == "True"
        if not crd_existed:  # absent before, so registered by this `helm install`
            shown = kubectl_json(k8s, "get", "crd", CRD_NAME, "--show-managed-fields")
            managers = {m["manager"] for m in shown["metadata"]["managedFields"]}
            assert "helm" in managers, managers
        source = yaml.safe_load((CHART_DIR / "crds" / f"{CRD_NAME}.yaml").read_text())
        assert crd["spec"]["names"]["shortNames"] == source["spec"]["names"]["shortNames"]
        assert [v["name"] for v in crd["spec"]["versions"]] == [
            v["name"] for v in source["spec"]["versions"]
        ]
        assert (crd["spec"]["versions"][0]["schema"]
                == source["spec"]["versions"][0]["schema"]), "the registered CRD is not the chart's"

        manifest = list(yaml.safe_load_all(k8s.helm("get", "manifest", RELEASE, "-n", ops).stdout))
        objects = [(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace"))
                   for o in manifest if o]
        kinds = sorted(k for k, _, _ in objects)
        rbac = (["ClusterRole", "ClusterRoleBinding"] * 2 if watch == "all-namespaces"
                else ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"])
        election = ["Role", "RoleBinding"]  # the replicas' Lease, in the operator's namespace
        assert kinds == sorted(["ServiceAccount", "Service", "Deployment", *rbac, *election])
        assert {ns for kind, name, ns in objects if name.endswith("-leader-election")} == {ops}
        if watch == "one-namespace":
            assert {ns for kind, name, ns in objects
                    if kind.startswith("Role") and not name.endswith("-leader-election")} == {llm}
        for kind, name, ns in objects:
            args = ["-n", ns] if ns else []
            k8s.kubectl(*args, "get", kind.lower(), name)  # each exists on the API server
        (sa,) = [name for kind, name, _ in objects if kind == "ServiceAccount"]
        (deploy_name,) = [name for kind, name, _ in objects if kind == "Deployment"]

        # The operator's own pod was admitted by the namespace's enforced Restricted level
        # (helm --wait saw the Deployment available: KWOK runs the pod on the CPU node).
        deploy = kubectl_json(k8s, "-n", ops, "get", "deployment", deploy_name)
        assert deploy["status"].get("availableReplicas") == 2  # a leader and a standby
        pod_template = deploy["spec"]["template"]
        assert restricted_violations(pod_template["spec"]) == []

        # -- 2. the operator, authenticated as the chart's ServiceAccount ------------------
        token = k8s.kubectl("-n", ops, "create", "token", sa, "--duration=3600s").stdout.strip()
        sa_kubeconfig = k8s.kubeconfig_for_token(token, tmp_path / "operator.kubeconfig")

        def as_operator(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [str(k8s.bin_dir / "kubectl"), f"--kubeconfig={sa_kubeconfig}", *args],
                capture_output=True, text=True, check=False,
            )

        # Least privilege, seen from the ServiceAccount: it reads pods, never Secrets, and
        # deletes nothing but a worker role's old workload when it changes kind (children go with
        # their owner through the garbage collector).
        everywhere = "yes" if watch == "all-namespaces" else "no"
        assert as_operator("auth", "can-i", "list", "pods", "-A").stdout.strip() == everywhere
        assert as_operator("auth", "can-i", "list", "pods", "-n", llm).stdout.strip() == "yes"
        assert as_operator("auth", "can-i", "get", "secrets", "-A").stdout.strip() == "no"
        assert as_operator("auth", "can-i", "delete", "pods", "-A").stdout.strip() == "no"
        assert as_operator("auth", "can-i", "delete", "services", "-n", llm).stdout.strip() == "no"
        assert as_operator("auth", "can-i", "delete", "deployments", "-A").stdout.strip() == everywhere
        assert as_operator("auth", "can-i", "create", "pods", "-A").stdout.strip() == "no"

        (container,) = pod_template["spec"]["containers"]
        health_port = free_port()
        args = [a for a in container["args"] if not a.startswith("--liveness")]
        args.append(f"--liveness=http://127.0.0.1:{health_port}/healthz")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KUBERNETES_", "TANDEM_"))}
        env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
        env.update({"KUBECONFIG": str(sa_kubeconfig), "POD_NAMESPACE": ops,
                    "PYTHONUNBUFFERED": "1"})

        with operator_process(args, env, operator_log) as proc:
            health = f"http://127.0.0.1:{health_port}/healthz"
            wait_until(lambda: proc.poll() is None and http_ok(health), timeout=90,
                       what=f"the operator's liveness endpoint {health}")

            # `helm test`'s check, run here against the live endpoint (its pod would need a
            # real container runtime): the same script, the same environment variable.
            hooks = [h for h in yaml.safe_load_all(
                k8s.helm("get", "hooks", RELEASE, "-n", ops).stdout) if h]
            (test_pod,) = [h for h in hooks
                           if h["metadata"]["annotations"]["helm.sh/hook"] == "test"]
            (check,) = test_pod["spec"]["containers"]
            assert check["command"][:2] == ["python", "-c"]
            check_env = dict(env, TANDEM_OPERATOR_HEALTH_URL=health)
            done = subprocess.run([sys.executable, "-c", check["command"][2]], env=check_env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0 and "HTTP 200" in done.stdout, done.stdout + done.stderr

            # -- 3. kubectl apply of the GPU/RoCE example ---------------------------------
            example = yaml.safe_load(EXAMPLE.read_text())
            name = example["metadata"]["name"]
            example["metadata"]["namespace"] = llm  # the file says `serving`
            spec = example["spec"]
            pv = model_volume(k8s, llm, spec["model"]["pvc"]["claimName"])
            secret = spec["router"].get("apiKeySecretRef")
            if secret:
                k8s.kubectl("-n", llm, "create", "secret", "generic", secret["name"],
                            f"--from-literal={secret['key']}=test-key")
            applied = time.monotonic()
            k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(example))

            tis: dict = {}
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                tis = kubectl_json(k8s, "-n", llm, "get", "tis", name)
                ready = condition(tis, "Ready")
                if ready.get("status") == "True":
                    break
                # A refusal of the chart's RBAC never heals: fail at once, saying which.
                assert "forbidden" not in ready.get("message", ""), ready["message"]
                assert proc.poll() is None, operator_log.read_text()[-4000:]
                time.sleep(1)
            else:
                pods = k8s.kubectl("-n", llm, "get", "pods", "-o", "wide").stdout
                pytest.fail(f"not Ready: {json.dumps(tis.get('status'), indent=1)}\n{pods}\n"
                            f"operator log:\n{operator_log.read_text()[-4000:]}")
            ready_after = time.monotonic() - applied
            endpoint = tis["status"]["endpoint"]
            port = spec["router"]["service"]["port"]
            assert endpoint == f"http://{name}-router.{llm}.svc.cluster.local:{port}"
            for cond in ("PrefillReady", "DecodeReady", "RouterReady"):
                assert condition(tis, cond)["status"] == "True", cond

            # Workers run the worker image, the router its own (the chart's defaults; no torch in it).
            images = {d["metadata"]["labels"]["tandem.dev/role"]: d["spec"]["template"]["spec"]["containers"][0]["image"]
                      for d in kubectl_json(k8s, "-n", llm, "get", "deployments",
                                            "-l", f"tandem.dev/service={name}")["items"]}
            assert images == {"prefill": "ghcr.io/tandem-dev/tandem-worker:0.1.0",
                              "decode": "ghcr.io/tandem-dev/tandem-worker:0.1.0",
                              "router": "ghcr.io/tandem-dev/tandem-router:0.1.0"}, images

            # The real scheduler put each role on its pool (GPU nodes are tainted).
            nodes = {n["metadata"]["name"]: n["metadata"]["labels"].get(POOL_LABEL)
                     for n in kubectl_json(k8s, "get", "nodes")["items"]}
            pods = kubectl_json(k8s, "-n", llm, "get", "pods",
                                "-l", f"tandem.dev/service={name}")["items"]
            by_role: dict[str, list[str]] = {}
            for pod in pods:
                assert pod["status"]["phase"] == "Running", pod["metadata"]["name"]
                role = pod["metadata"]["labels"]["tandem.dev/role"]
                by_role.setdefault(role, []).append(nodes[pod["spec"]["nodeName"]])
            assert sorted(by_role["prefill"]) == ["prefill"] * spec["prefill"]["replicas"]
            assert sorted(by_role["decode"]) == ["decode"] * spec["decode"]["replicas"]
            assert len(by_role["router"]) == spec["router"]["replicas"]

            # The chart's optional PodMonitor (rendered, not installed: no Prometheus Operator
            # here) selects exactly these pods, on a container port they have.
            monitors = {m["metadata"]["name"].rsplit("-", 1)[-1]: m for m in find(
                render(k8s.bin_dir / "helm", release=RELEASE, namespace=ops,
                       **{"monitoring.podMonitor.enabled": True}), "PodMonitor")}
            monitor = monitors["workloads"]
            keys = [e["key"] for e in monitor["spec"]["selector"]["matchExpressions"]]
            selected = kubectl_json(k8s, "-n", llm, "get", "pods", "-l", ",".join(keys))["items"]
            assert sorted(p["metadata"]["name"] for p in selected) == sorted(
                p["metadata"]["name"] for p in pods)
            port_name = monitor["spec"]["podMetricsEndpoints"][0]["port"]
            for pod in pods:
                ports = [p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])]
                assert port_name in ports, (pod["metadata"]["name"], ports)

            # The operator's PodMonitor selects the chart's two operator pods, on their health port;
            # the operator serves its own metrics there (here: this process, the leader).
            labels = ",".join(f"{k}={v}" for k, v in monitors["operator"]["spec"]["selector"]["matchLabels"].items())
            operator_pods = kubectl_json(k8s, "-n", ops, "get", "pods", "-l", labels)["items"]
            assert len(operator_pods) == 2
            for pod in operator_pods:
                assert "health" in [p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])]
            metrics_url = f"http://127.0.0.1:{health_port}/metrics"
            with urllib.request.urlopen(metrics_url, timeout=5) as resp:
                scraped = resp.read().decode()
            assert "tandem_operator_leader 1.0" in scraped, scraped[-2000:]
            assert re.search(r'tandem_operator_reconciles_total\{trigger="spec"\} [1-9]', scraped), scraped[-3000:]
            assert "tandem_operator_reconcile_duration_seconds_bucket" in scraped

            table = k8s.kubectl("-n", llm, "get", "tis").stdout
            row = next(line for line in table.splitlines() if line.startswith(name))
            assert "True" in row and endpoint in row, table
            described = k8s.kubectl("-n", llm, "describe", "tis", name).stdout
            for text in ("Conditions:", "PrefillReady", "DecodeReady", "RouterReady",
                         "Events:", "Created"):
                assert text in described, f"{text!r} not in:\n{described}"

            # Pod Security, judged by the API server: the router passes Restricted; the
            # RDMA workers (IPC_LOCK) pass only at privileged, as docs/install.md says.
            deployments = {
                d["metadata"]["labels"]["tandem.dev/role"]: d["spec"]["template"]
                for d in kubectl_json(k8s, "-n", llm, "get", "deployments",
                                      "-l", f"tandem.dev/service={name}")["items"]
            }
            router_template = dict(deployments["router"])
            router_template["spec"] = dict(router_template["spec"],
                                           serviceAccountName="default")
            admitted = dry_run_pod(k8s, ops, router_template, "router-dry-run")
            assert admitted.returncode == 0, admitted.stderr
            decode_template = dict(deployments["decode"])
            decode_template["spec"] = dict(decode_template["spec"],
                                           serviceAccountName="default")
            with scratch_namespace(k8s, f"{ops}-base", "baseline") as baseline:
                refused = dry_run_pod(k8s, baseline, decode_template, "decode-dry-run")
            assert refused.returncode != 0
            assert "violates PodSecurity" in refused.stderr and "IPC_LOCK" in refused.stderr

            # -- 4. helm uninstall: the chart's objects go, the InferenceService stays --
            # The operator's Deployment is the first thing uninstall removes; here the
            # operator is this process, stopped the same way (SIGTERM).
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, operator_log.read_text()[-3000:]
            k8s.helm("uninstall", RELEASE, "-n", ops, "--wait", "--timeout", "120s")
            installed = False
            for kind, obj_name, ns in objects:
                args_ns = ["-n", ns] if ns else []
                gone = k8s.kubectl(*args_ns, "get", kind.lower(), obj_name, check=False)
                assert gone.returncode != 0 and "NotFound" in gone.stderr, (kind, obj_name)
            # The ServiceAccount's token died with it.
            wait_until(
                lambda: "Unauthorized" in as_operator("get", "tis", "-A").stderr,
                timeout=30, what="the ServiceAccount's token to be refused",
            )
            # Helm neither upgrades nor deletes CRDs from crds/: the CRD, the CR and its
            # workloads keep running, unmanaged.
            k8s.kubectl("get", "crd", CRD_NAME)
            k8s.kubectl("-n", llm, "get", "tis", name)
            left = kubectl_json(k8s, "-n", llm, "get", "deployments",
                                "-l", f"tandem.dev/service={name}")["items"]
            assert sorted(d["metadata"]["name"] for d in left) == sorted(
                f"{name}-{r}" for r in ("prefill", "decode", "router"))
            running = [p for p in kubectl_json(k8s, "-n", llm, "get", "pods",
                                               "-l", f"tandem.dev/service={name}")["items"]
                       if p["status"]["phase"] == "Running"]
            assert len(running) == len(pods)
            # No finalizer: deleting the CR without an operator works, and the garbage
            # collector removes its children through their owner references.
            k8s.kubectl("-n", llm, "delete", "tis", name, "--timeout=60s")
            wait_until(
                lambda: not kubectl_json(k8s, "-n", llm, "get", "deployments,services,"
                                         "configmaps,serviceaccounts,roles,rolebindings",
                                         "-l", f"tandem.dev/service={name}")["items"],
                timeout=90, what="the garbage collector to remove the children",
            )
    finally:
        namespaces.close()
        if installed:
            k8s.helm("uninstall", RELEASE, "-n", ops, "--wait", "--timeout", "120s", check=False)
        if pv:
            k8s.kubectl("delete", "pv", pv, "--wait=false", check=False)

    log = operator_log.read_text(errors="replace")
    # An authorization refusal or kopf's "Not enough permissions" anywhere in the operator's
    # log: the chart's RBAC is missing something (tandem.testing.rbac says what counts).
    denied_lines = rbac_denials(log)
    assert not denied_lines, "the operator hit missing permissions:\n" + "\n".join(denied_lines)
    print(f"CRD existed before install: {crd_existed}; Ready {ready_after:.1f}s after apply")
