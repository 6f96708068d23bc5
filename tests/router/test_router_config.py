"""Router settings: defaults < the operator's YAML < env < flags, and typos refused."""

from __future__ import annotations

import argparse

import pytest
import yaml
from tandem.router import cli
from tandem.router.config import RouterConfig, apply, flatten, load_yaml


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_camel_case_and_sections_are_accepted(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"limits": {"maxTokensLimit": 10, "maxBodyBytes": 99},
                                 "routing": {"shortPromptThreshold": 5}, "decode": ["http://d:1"]}))
    c = load_yaml(f)
    assert (c.max_tokens_limit, c.max_body_bytes, c.short_prompt_threshold, c.decode) == (10, 99, 5, ["http://d:1"])
    assert flatten({"maxOutputTokens": 3}) == {"max_tokens_limit": 3}


def test_unknown_keys_and_policies_are_refused(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("max_tokens_limt: 10\n")
    with pytest.raises(ValueError, match="max_tokens_limt"):
        load_yaml(f)
    f.write_text("policy: random\n")
    with pytest.raises(ValueError, match="random"):
        load_yaml(f)


def test_flags_override_file_and_env_gives_the_key(tmp_path, monkeypatch):
    f = tmp_path / "r.yaml"
    f.write_text("port: 9000\nmax_tokens_limit: 10\ndecode: [http://d:1]\n")
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    c = cli.config_from_args(_args(["--config", str(f), "--port", "9100"]))
    assert (c.port, c.max_tokens_limit, c.api_key) == (9100, 10, "from-env")
    c = cli.config_from_args(_args(["--config", str(f), "--api-key", "flag"]))
    assert c.api_key == "flag"


def test_discovery_must_be_given():
    with pytest.raises(SystemExit, match="--decode"):
        cli.config_from_args(_args([]))
    with pytest.raises(SystemExit, match="--service"):
        cli.config_from_args(_args(["--kubernetes", "--namespace", "ns"]))
    c = cli.config_from_args(_args(["--kubernetes", "--namespace", "ns", "--service", "svc"]))
    assert (c.kubernetes, c.namespace, c.service) == (True, "ns", "svc")


def test_the_operators_rendered_router_config_loads(tmp_path):
    """Engineer B's renderer writes the file this router reads: every key must be one we know."""
    from tandem.operator import render
    spec = {
        "model": {"maxModelLen": 4096, "servedName": "llama"},
        "router": {"policy": "prefix-aware", "shortPromptTokens": 32, "limits": {"maxBodyBytes": 1 << 20},
                   "service": {"port": 80}, "prefillSaturatedTokens": 3000, "decodeHeadroomSequences": 4,
                   "prefixSequenceCostTokens": 99},
    }
    f = tmp_path / "router.yaml"
    f.write_text(yaml.safe_dump(render.router_config("svc", "ns", spec)))
    c = load_yaml(f)
    assert isinstance(c, RouterConfig)
    assert (c.kubernetes, c.namespace, c.service, c.model) == (True, "ns", "svc", "llama")
    assert c.short_prompt_threshold == 32 and c.max_body_bytes == 1 << 20
    assert c.max_prompt_tokens == 4095
    assert (c.policy, c.prefill_saturated_tokens, c.decode_headroom_sequences, c.prefix_sequence_cost_tokens) == (
        "prefix-aware", 3000, 4, 99)
    assert c.tokenizer == "workers"  # a router pod has no model volume: it fetches the workers' tokenizer


def test_routing_settings_are_checked(tmp_path):
    for key, bad in (("prefill_saturated_tokens", -1), ("decode_headroom_sequences", 0),
                     ("prefix_sequence_cost_tokens", "many"), ("short_prompt_threshold", True)):
        with pytest.raises(ValueError, match=key):
            apply(RouterConfig(), {key: bad}, "test")
    with pytest.raises(ValueError, match="tokenizer must be"):
        cli.config_from_args(_args(["--decode", "http://d:1", "--tokenizer", str(tmp_path)]))
    c = cli.config_from_args(_args(["--decode", "http://d:1", "--tokenizer", "off", "--prefill-saturated-tokens",
                                    "0", "--decode-headroom-sequences", "2", "--policy", "prefix-aware"]))
    assert (c.tokenizer, c.prefill_saturated_tokens, c.decode_headroom_sequences, c.policy) == (
        "off", 0, 2, "prefix-aware")
