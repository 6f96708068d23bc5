"""The prefix_caching setting reaches the engine from flags and from the operator's config file,
and defaults to on."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tandem.worker.server.cli import add_arguments, resolve_settings


def settings(*argv: str):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve_settings(p.parse_args(["--model", "/m", *argv]))


def test_on_by_default_and_off_by_flag():
    assert settings().engine_config().prefix_caching is True
    assert settings("--no-prefix-caching").engine_config().prefix_caching is False
    assert settings("--prefix-caching").engine_config().prefix_caching is True


def test_the_config_file_sets_it_and_a_flag_wins(tmp_path: Path):
    cfg = tmp_path / "worker.yaml"
    cfg.write_text("model: /m\nprefix_caching: false\n")
    assert settings("--config", str(cfg)).engine_config().prefix_caching is False
    assert settings("--config", str(cfg), "--prefix-caching").engine_config().prefix_caching is True
    cfg.write_text("model: /m\nprefix_caching: maybe\n")
    with pytest.raises(ValueError, match="prefix_caching must be true or false"):
        settings("--config", str(cfg))
