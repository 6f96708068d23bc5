"""The ConfigMap the operator renders is accepted, key for key, by `tandem worker` and `tandem router`.

Both refuse unknown keys, so a renamed setting on either side fails here, not in a pod.
"""

from __future__ import annotations

import argparse

from tandem.operator.render import config_files


def _worker_settings(tmp_path, text: str):
    from tandem.worker.server.cli import add_arguments, resolve_settings

    path = tmp_path / "worker.yaml"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve_settings(parser.parse_args(["--config", str(path)]))


def test_worker_reads_each_role_file(tmp_path, typed, examples):
    spec = typed(examples["gpu-roce"]["spec"])
    files = config_files("llama-8b", "serving", spec)
    for role in ("prefill", "decode"):
        s = _worker_settings(tmp_path, files[f"{role}.yaml"])
        assert s.role == role and s.model == "/models"
        assert s.served_name == "meta-llama/Llama-3.1-8B-Instruct"
        assert s.dtype == "bfloat16" and s.max_model_len == 8192
        assert s.kv_backend == "nixl" and s.block_size == 16
        assert s.max_num_seqs == spec.role(role).engine.max_num_seqs
        assert s.kv_memory_fraction == spec.role(role).engine.kv_memory_fraction


def test_router_reads_its_file(tmp_path, typed, examples):
    from tandem.router.config import load_yaml

    spec = typed(examples["gpu-roce"]["spec"])
    path = tmp_path / "router.yaml"
    path.write_text(config_files("llama-8b", "serving", spec)["router.yaml"])
    cfg = load_yaml(path)
    assert cfg.kubernetes is True and cfg.namespace == "serving" and cfg.service == "llama-8b"
    assert cfg.max_prompt_tokens == 7168 and cfg.max_tokens_limit == 1024
    assert cfg.max_body_bytes == 4194304 and cfg.policy == "least-loaded"
    assert cfg.model == "meta-llama/Llama-3.1-8B-Instruct" and cfg.port == 8000
    assert cfg.first_token == "at-once"
    held = typed(examples["gpu-roce"]["spec"] | {"router": {"firstToken": "with-decode"}})
    path.write_text(config_files("llama-8b", "serving", held)["router.yaml"])
    assert load_yaml(path).first_token == "with-decode"
