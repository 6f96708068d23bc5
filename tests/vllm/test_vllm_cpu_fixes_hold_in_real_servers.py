"""The launcher's two CPU fixes hold in real vLLM servers (worker/vllm/cpu_fixes.py): each server's
compute thread (its worker process's main thread) stays on the core `tandem up --pin-cpus` gave it,
where vLLM's NIXL worker would move it onto the machine's last core; and an idle server has no
thread busy-polling (NIXL's progress thread, runnable all the time with NIXL's own zero delay,
sleeps a millisecond between its polls). That the delay reaches the agent NIXL builds: in vLLM's
own interpreter, below. (What it does under load: BENCHMARKS.md, "Tandem on vLLM", the curves.)"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _compute_process(server_pid: int) -> psutil.Process:
    workers = [p for p in psutil.Process(server_pid).children(recursive=True) if p.name() == "VLLM::Worker"]
    assert len(workers) == 1, f"one vLLM worker process under {server_pid}, found {workers}"
    return workers[0]


def _runnable_share(pids: list[int], samples: int = 40, every_s: float = 0.05) -> dict[tuple[int, int], float]:
    """For each thread of `pids`, the share of samples in which it was running or runnable."""
    counts: dict[tuple[int, int], int] = {}
    for _ in range(samples):
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                try:
                    state = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                key = (pid, int(task.name))
                counts[key] = counts.get(key, 0) + (state == "R")
        time.sleep(every_s)  # a sampling interval, not a wait for a condition
    return {k: n / samples for k, n in counts.items()}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_compute_thread_runs_on_the_core_tandem_assigned(vllm_servers, role: str) -> None:
    server = psutil.Process(vllm_servers.pid(role))
    assigned = server.cpu_affinity()
    assert len(assigned) == 1, f"tandem up --pin-cpus gives {role} one core, got {assigned}"
    worker = _compute_process(server.pid)
    vllm_servers.post(role, "/v1/completions", {"model": vllm_servers.served, "max_tokens": 8, "temperature": 0,
                                                 "prompt": f"A paged key value cache for the {role} server"})
    assert worker.cpu_affinity() == assigned  # the main thread's (tid == pid) allowed cores
    assert worker.cpu_num() == assigned[0]  # and where it last ran: the request's forward passes


def test_an_idle_server_has_no_busy_polling_thread(vllm_servers) -> None:
    for role in ("prefill", "decode"):
        server = psutil.Process(vllm_servers.pid(role))
        pids = [server.pid, *(p.pid for p in server.children(recursive=True))]
        # A busy-polling thread never sleeps: runnable in (nearly) every sample. A thread finishing
        # the work of a request just served (a fresh clone's run found the prefill server's API
        # thread runnable in half of 40 samples right after one) is not one.
        busy = {k: share for k, share in _runnable_share(pids, samples=80).items() if share >= 0.8}
        assert not busy, f"{role}: threads (pid, tid) runnable in nearly every sample while idle: {busy}"


DELAY_PROBE = """
import sys
import tandem_vllm_cpu_fixes as fixes
fixes.register()
import vllm.distributed.nixl_utils as nixl_utils
agent_cls = nixl_utils.NixlWrapper  # what vLLM's NIXL worker builds its agent with
config = sys.modules[agent_cls.__module__].nixlBind.nixlAgentConfig()
config.pthrDelay = 0  # what NIXL's python API writes before it builds the agent
agent = agent_cls("probe", nixl_utils.nixl_agent_config(backends=[]))  # NIXL takes the config
print("pthrDelay", config.pthrDelay)
"""


def test_the_progress_threads_delay_reaches_nixls_agent_config(vllm_installed) -> None:
    from tandem.worker.local.cache import cache_root
    from tandem.worker.vllm.launch import NIXL_PROGRESS_DELAY_US, plugin_dir

    env = os.environ | {"PYTHONPATH": str(plugin_dir(cache_root())),
                        "TANDEM_NIXL_PROGRESS_DELAY_US": str(NIXL_PROGRESS_DELAY_US)}
    out = subprocess.run([str(vllm_installed), "-c", DELAY_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"pthrDelay {NIXL_PROGRESS_DELAY_US}" in out.stdout.splitlines(), out.stdout
