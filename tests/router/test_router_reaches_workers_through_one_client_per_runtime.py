"""The runtime seam on the router (issue 32 item 5): workers are reached through the worker client
of the configured runtime, chosen by name from runtimes/registry.py and imported only when chosen;
an unknown runtime is refused when the config loads, naming the known ones; and nothing in the
router builds Tandem's HTTP client but the `tandem` runtime's factory, so the seam holds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tandem.router import config as router_config
from tandem.router.config import RouterConfig, apply
from tandem.router.runtimes import registry
from tandem.router.worker_client import HttpWorkerClient

ROUTER = Path(__file__).resolve().parents[2] / "router"
# Where Tandem's client may be constructed: its own module and the `tandem` runtime's factory.
SEAM = {"worker_client.py", "runtimes/tandem.py"}


def test_the_default_runtime_is_tandem_and_its_client_is_the_http_one():
    config = RouterConfig(connect_timeout_s=1.5, prefill_timeout_s=7.0, chunk_timeout_s=9.0)
    config.internal_secret = "s3cret"
    assert config.runtime == "tandem"
    client = registry.create_client(object(), config)  # the factory only keeps the session
    assert isinstance(client, HttpWorkerClient)
    t = client.timeouts
    assert (t.connect_s, t.prefill_s, t.chunk_s) == (1.5, 7.0, 9.0)
    assert client._secret == "s3cret"


def test_an_unknown_runtime_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown runtime 'sglang'; known: \['tandem', 'vllm'\]"):
        apply(RouterConfig(), {"runtime": "sglang"}, "flags")
    path = tmp_path / "router.yaml"
    path.write_text("runtime: nope\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: unknown runtime 'nope'"):
        router_config.load_yaml(path)
    path.write_text("runtime: tandem\n")
    assert router_config.load_yaml(path).runtime == "tandem"


def test_a_runtime_is_imported_only_when_chosen(monkeypatch):
    missing = "tandem_test_runtime_that_is_not_installed"
    monkeypatch.setitem(registry.RUNTIMES, "other", f"{missing}:create_client")
    registry.check_runtime("other")  # a known name: nothing imported to say so
    assert registry.client_factory("tandem") is not None
    assert missing not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        registry.client_factory("other")


def test_loading_the_config_imports_no_runtime():
    """The CLI and the config name runtimes without importing any (nor aiohttp)."""
    code = ("import sys; import tandem.router.cli, tandem.router.config; "
            "print(sorted(m for m in sys.modules if m.startswith('tandem.router.runtimes.') "
            "and m != 'tandem.router.runtimes.registry' or m == 'aiohttp'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_only_the_seam_constructs_tandems_worker_client():
    builds = re.compile(r"\bHttpWorkerClient\s*\(")
    offenders = [path.relative_to(ROUTER).as_posix() for path in sorted(ROUTER.rglob("*.py"))
                 if path.relative_to(ROUTER).as_posix() not in SEAM and builds.search(path.read_text())]
    assert offenders == [], f"build worker clients through tandem.router.runtimes.registry: {offenders}"
    assert builds.search((ROUTER / "runtimes/tandem.py").read_text())  # the check still sees the one
