"""The worker's settings are typed: a wrong type in the operator's ConfigMap or on the command line
stops the worker at start-up with a message that names the key. The internal secret comes from the
environment or a file, never from flags or YAML."""

from __future__ import annotations

import argparse

import pytest
from tandem.contracts.internal_auth import SECRET_ENV
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


SECRET_VALUE = "s3cret-for-this-service-only-0123"


def test_secret_comes_from_the_environment_or_a_file_never_from_flags_or_yaml(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert _load(tmp_path, "model: /m\n").internal_secret is None
    monkeypatch.setenv(SECRET_ENV, SECRET_VALUE + "\n")
    cfg = _load(tmp_path, "model: /m\nrole: prefill\nkv_backend: tcp\n")
    assert cfg.internal_secret == SECRET_VALUE
    assert SECRET_VALUE not in repr(cfg) and "internal_secret" not in cfg.public()
    kv = cfg.kv_transfer_config("10.0.0.1")
    assert kv.secret == SECRET_VALUE and kv.port == 5601 and kv.serve and SECRET_VALUE not in repr(kv)
    assert not _load(tmp_path, "model: /m\nrole: decode\nmigrate_on_drain: false\n").kv_transfer_config("h").serve

    mounted = tmp_path / "secret"
    mounted.write_text("from-a-mounted-secret-file-789\n")
    cfg = _load(tmp_path, "model: /m\n", "--internal-secret-file", str(mounted), "--kv-port", "0")
    assert cfg.internal_secret == "from-a-mounted-secret-file-789" and cfg.kv_port == 0  # the file wins

    with pytest.raises(ValueError, match="never a setting"):
        _load(tmp_path, f"model: /m\ninternal_secret: {SECRET_VALUE}\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):  # refused, not taken as an abbreviation of --internal-secret-file
        parser.parse_args(["--model", "/m", "--internal-secret", SECRET_VALUE])
    assert "never a flag" in capsys.readouterr().err
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 characters") as err:
        _load(tmp_path, "model: /m\n")
    assert "short" not in str(err.value)
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(OSError):
        _load(tmp_path, "model: /m\n", "--internal-secret-file", str(tmp_path / "missing"))


def test_decode_migrates_on_drain_by_default_and_then_serves_kv(tmp_path):
    """A decode worker hands its sequences to other decode workers on SIGTERM unless told not to;
    it then serves KV like a prefill worker. Only a worker with a KV backend, never prefill, can."""
    decode = _load(tmp_path, "model: /m\nrole: decode\n")
    assert decode.migrate_on_drain is True and decode.kv_transfer_config("h").serve
    assert _load(tmp_path, "model: /m\n").migrate_on_drain is False, "colocated: off by default"
    assert _load(tmp_path, "model: /m\nrole: decode\n", "--no-migrate-on-drain").migrate_on_drain is False
    with pytest.raises(ValueError, match="migrate_on_drain needs a decode or colocated worker"):
        _load(tmp_path, "model: /m\nrole: prefill\nmigrate_on_drain: true\n")
    with pytest.raises(ValueError, match="kv_backend none"):
        _load(tmp_path, "model: /m\nrole: colocated\nmigrate_on_drain: true\n")
