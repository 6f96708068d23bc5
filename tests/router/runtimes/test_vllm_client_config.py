"""The router's settings for the vllm runtime (issue 29): `--runtime vllm` needs the model's tokenizer
folder (vLLM serves no tokenizer files), refused with what to pass, and probes handoffs as the tandem
runtime does (router/parity/probe.py scores through vLLM's prompt_logprobs); the KV event publishers are found per worker URL
(`--kv-events URL=ENDPOINT`) or on the worker's host (`--kv-events-port`); the runtime's factory
builds the vLLM client with those settings and the folder's digest."""

from __future__ import annotations

import argparse

import pytest
from tandem.contracts.vllm_serve import KV_EVENTS_PORT
from tandem.router import cli
from tandem.router.config import RouterConfig, apply
from tandem.router.runtimes import registry
from tandem.router.runtimes.vllm import VllmWorkerClient
from tandem.router.tokenizer_sync import read_dir


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_runtime_vllm_needs_a_tokenizer_folder_and_probes_handoffs(toy_model_dir):
    base = ["--decode", "http://d:1", "--runtime", "vllm"]
    with pytest.raises(ValueError, match=r"runtime vllm needs the served model's tokenizer files.*--tokenizer DIR"):
        cli.config_from_args(_args(base))
    c = cli.config_from_args(_args(base + ["--tokenizer", str(toy_model_dir)]))
    assert (c.runtime, c.tokenizer, c.parity_probe, c.kv_events_port) == ("vllm", str(toy_model_dir), True,
                                                                          KV_EVENTS_PORT)


def test_kv_event_publishers_are_named_per_worker_or_by_port(toy_model_dir):
    c = cli.config_from_args(_args([
        "--decode", "http://127.0.0.1:8101", "--prefill", "http://127.0.0.1:8102/", "--runtime", "vllm",
        "--tokenizer", str(toy_model_dir), "--no-parity-probe", "--kv-events-port", "6000",
        "--kv-events", "http://127.0.0.1:8102/=tcp://127.0.0.1:5602"]))
    assert c.kv_events_endpoints == {"http://127.0.0.1:8102": "tcp://127.0.0.1:5602"}
    client = registry.create_client(object(), c)  # the factory only keeps the session
    assert isinstance(client, VllmWorkerClient)
    assert client.kv_endpoint("http://127.0.0.1:8102") == "tcp://127.0.0.1:5602"
    assert client.kv_endpoint("http://127.0.0.1:8101") == "tcp://127.0.0.1:6000"
    assert client.kv_endpoint("http://[fd00::7]:8000") == "tcp://[fd00::7]:6000"
    assert client.files.sha256 == read_dir(toy_model_dir).sha256  # what `info` reports as the tokenizer's
    with pytest.raises(ValueError, match="kv_events_endpoints maps a worker URL"):
        apply(RouterConfig(), {"kv_events_endpoints": {"http://w:1": "w:5557"}}, "flags")
    with pytest.raises(ValueError, match="kv_events_port must be a port number"):
        apply(RouterConfig(), {"kv_events_port": 70000}, "flags")


def test_the_runtime_factory_refuses_an_incomplete_config(toy_model_dir):
    """A router built without the CLI (build_app in a test, a YAML file) is checked the same way."""
    with pytest.raises(ValueError, match="--tokenizer DIR"):
        registry.create_client(object(), RouterConfig(runtime="vllm", parity_probe=False))
