"""Choosing a KV backend by name imports only that backend: Tandem never requires nixl (or torch) to import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tandem.testing.kv_peer import SMALL_LAYOUT
from tandem.worker.kv.base import KVTransferConfig, KVTransport
from tandem.worker.kv.registry import BACKENDS, create_transport, transport_class


def test_importing_the_registry_loads_no_backend() -> None:
    code = ("import sys; import tandem.worker.kv.registry; "
            "heavy = [m for m in ('torch', 'nixl', 'nixl_cu12', 'tandem.worker.kv.tcp', "
            "'tandem.worker.kv.nixl', 'tandem.worker.kv.memory') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_backend_name_resolves_to_a_transport() -> None:
    for name in BACKENDS:
        if name == "nixl":
            pytest.importorskip("nixl_cu12", reason="needs the nixl package (nixl-cu12)")
        cls = transport_class(name)
        assert issubclass(cls, KVTransport) and cls.name == name


def test_create_transport_builds_the_named_backend_over_the_pool() -> None:
    pool = torch.zeros(SMALL_LAYOUT.shape)
    t = create_transport("tcp", pool, SMALL_LAYOUT, "e-1", KVTransferConfig(backend="tcp"))
    assert t.name == "tcp" and t.pool is pool and t.engine_id == "e-1"


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown KV transfer backend .*known: \[.memory., .nixl., .tcp.\]"):
        transport_class("rdma-magic")


def test_pool_not_matching_the_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="does not match the layout"):
        create_transport("tcp", torch.zeros(3, 4), SMALL_LAYOUT, "e-1", KVTransferConfig(backend="tcp"))
