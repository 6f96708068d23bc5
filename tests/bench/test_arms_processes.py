"""bench/lib/processes.py's BenchProcess: a ManagedProcess (own group, pinned, logged) that reports its
CPU and placement; bench/lib/arms.py's layouts."""

import sys
import time

from bench.lib.arms import Arm, ArmSpec
from bench.lib.processes import BenchProcess


def _wait_for(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_proc_is_pinned_logged_measured_and_stopped(tmp_path):
    code = "import signal; print('up', flush=True); sum(range(10**6)); signal.pause()"
    p = BenchProcess("child", "router", "", [sys.executable, "-c", code], 0, tmp_path / "logs" / "child.log")
    p.start({"PYTHONUNBUFFERED": "1"})
    try:
        _wait_for(lambda: "up" in p.log_tail())
        assert p.alive() and p.cmd[0] == sys.executable
        assert p.placement()["affinity"] == [0]  # pinned before exec, as observed
        assert p.cpu_seconds() > 0
    finally:
        p.stop(grace_s=5)
    assert not p.alive() and p.returncode is not None


def test_arm_layouts_plan_the_processes_they_name(tmp_path):
    one = Arm(ArmSpec("one", "colocated-1", "bfloat16", 256), tmp_path, tmp_path)
    one.plan_processes()
    (w,) = one.workers
    assert w.cpu is None and w.cmd[w.cmd.index("--threads") + 1] == "2"
    assert w.cmd[-4:] == ["--dtype", "bfloat16", "--prefill-chunk-tokens", "256"]
    assert one.router.cmd.count("--decode") == 1
    two = Arm(ArmSpec("two", "disagg-nixl", worker_args=("--compile=off",), router_args=("--policy", "x")), tmp_path,
              tmp_path)
    two.plan_processes()
    assert [(p.role, p.cpu) for p in two.workers] == [("prefill", 0), ("decode", 1)]
    assert all(p.cmd[p.cmd.index("--kv-backend") + 1] == "nixl" and p.cmd[-1] == "--compile=off" for p in two.workers)
    assert two.router.cmd.count("--prefill") == 1 and two.router.cmd[-2:] == ["--policy", "x"]
    chaos = Arm(ArmSpec("chaos", "chaos"), tmp_path, tmp_path)
    chaos.plan_processes()
    assert [p.name for p in chaos.procs] == ["prefill-0", "prefill-1", "decode-0", "decode-1", "router-0", "router-1"]
    assert all(p.cpu is None for p in chaos.workers)
