"""The worker's settings are typed: a wrong type in the operator's ConfigMap or on the command line
stops the worker at start-up with a message that names the key."""

from __future__ import annotations

import argparse

import pytest
from tandem.contracts.names import KVBackend, Role
from tandem.worker.server.cli import add_arguments, resolve_settings
from tandem.worker.server.config import WorkerConfig


def _load(tmp_path, text: str, *flags: str) -> WorkerConfig:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve_settings(parser.parse_args(["--config", str(path), *flags]))


def test_values_get_their_types_and_role_defaults(tmp_path):
    cfg = _load(tmp_path, "model: /m\nrole: decode\nkv_timeout_s: 3\nmax-num-seqs: 7\n")
    assert cfg.role is Role.DECODE and cfg.kv_backend is KVBackend.NIXL
    assert cfg.kv_timeout_s == 3.0 and isinstance(cfg.kv_timeout_s, float) and cfg.max_num_seqs == 7
    assert _load(tmp_path, "model: /m\n").kv_backend is KVBackend.NONE  # colocated hands nothing off


def test_flags_win_over_the_file(tmp_path):
    cfg = _load(tmp_path, "model: /m\nmax_num_seqs: 7\n", "--max-num-seqs", "9", "--role", "prefill")
    assert cfg.max_num_seqs == 9 and cfg.role is Role.PREFILL


@pytest.mark.parametrize(("text", "message"), [
    ("model: /m\nmax_num_seqs: lots\n", "max_num_seqs must be an integer, got 'lots'"),
    ("model: /m\nmax_num_seqs: true\n", "max_num_seqs must be an integer"),
    ("model: /m\nrole: both\n", "role must be one of prefill, decode, colocated"),
    ("model: /m\nkv_backend: smoke\n", "kv_backend must be one of nixl, tcp, memory, none or null"),
    ("model: /m\nkv_lease_s: null\n", "kv_lease_s must be set"),
    ("model: /m\nmax_seqs: 4\n", "unknown setting 'max_seqs'"),
    ("role: decode\n", "--model (or `model:` in --config) is required"),
])
def test_bad_values_name_the_key(tmp_path, text, message):
    with pytest.raises(ValueError, match=None) as err:
        _load(tmp_path, text)
    assert message in str(err.value)
