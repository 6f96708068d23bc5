"""`tandem up` starts its processes where asked and never leaves one behind, however it ends."""

from __future__ import annotations

import argparse
import os
import signal
import time

import psutil
import pytest
from tandem.testing.local_stack import LocalStack
from tandem.worker.local import up


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_plan_disaggregated_pins_workers_and_points_the_router_at_them(tmp_path):
    children = up.processes(_args(prefill=1, decode=2, pin_cpus=True, kv_backend="tcp", threads=2), tmp_path)
    assert [c.name for c in children] == ["prefill-0", "decode-0", "decode-1", "router"]
    cores = sorted(os.sched_getaffinity(0))
    assert [c.cpu for c in children[:3]] == [cores[i % len(cores)] for i in range(3)]
    assert children[-1].cpu is None
    for c in children[:3]:
        assert c.argv[c.argv.index("--kv-backend") + 1] == "tcp"
        assert c.argv[c.argv.index("--threads") + 1] == "2" and c.env["OMP_NUM_THREADS"] == "2"
    router = children[-1].argv
    assert router[router.index("--prefill") + 1] == children[0].url
    assert [router[i + 1] for i, a in enumerate(router) if a == "--decode"] == [children[1].url, children[2].url]
    assert len({c.url for c in children}) == 4


def test_plan_colocated_has_no_prefill_and_no_kv_backend(tmp_path):
    children = up.processes(_args(mode="colocated", decode=1, api_key="sekret"), tmp_path)
    assert [c.role for c in children] == ["colocated", "router"]
    assert "--kv-backend" not in children[0].argv and "--prefill" not in children[1].argv
    # the API key reaches the router through its environment, never its (world-readable) argv
    assert children[1].env["TANDEM_API_KEY"] == "sekret" and "sekret" not in " ".join(children[1].argv)
    # so does the internal secret, the same for every child, fresh for every plan
    secrets = {c.env["TANDEM_INTERNAL_SECRET"] for c in children}
    assert len(secrets) == 1 and len(secrets.pop()) >= 32
    assert not any(c.env["TANDEM_INTERNAL_SECRET"] in " ".join(c.argv) for c in children)


def _gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_stops_every_process_and_pins_cpus(toy_model_dir):
    stack = LocalStack(toy_model_dir, "colocated", ["--pin-cpus"]).start()
    try:
        pids = [p["pid"] for p in stack.processes]
        worker = psutil.Process(stack.workers()[0]["pid"])
        assert len(worker.cpu_affinity()) == 1  # pinned to one core
        assert "Tandem is ready at" in stack.log() and "curl -s" in stack.log()
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(30) == 0
        assert _gone(pids) == []
    finally:
        stack.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_children_die_with_a_killed_tandem_up(toy_model_dir):
    stack = LocalStack(toy_model_dir, "colocated").start()
    try:
        pids = [p["pid"] for p in stack.processes]
        stack.proc.kill()  # SIGKILL: no cleanup code runs in `tandem up`
        stack.proc.wait(10)
        assert _gone(pids) == []
    finally:
        stack.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_router_death_stops_everything(toy_model_dir):
    stack = LocalStack(toy_model_dir, "colocated").start()
    try:
        pids = [p["pid"] for p in stack.processes]
        stack.kill("router")
        assert stack.proc.wait(30) == 1
        assert _gone(pids) == []
        assert "the router exited" in stack.log()
    finally:
        stack.stop()


def test_a_model_no_worker_can_serve_is_refused_before_any_process_starts(tmp_path, capsys):
    import json

    from tandem.contracts.model_support import check_model_config

    config = {"model_type": "mamba", "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert up.run(_args(model=str(tmp_path))) == 2
    finally:
        signal.signal(signal.SIGTERM, before)  # run() installs its own handler
    assert check_model_config(config) in capsys.readouterr().err
