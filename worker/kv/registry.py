"""Chooses the KV transfer backend by name and imports it only then, so Tandem never requires nixl.

Same shape as vLLM's kv_connector factory: a name maps to "module:Class".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.contracts.kv_layout import KVLayout
from tandem.contracts.lazy_registry import resolve
from tandem.worker.kv.base import KVTransferConfig, KVTransport, LeaseKeeper

if TYPE_CHECKING:
    import torch

BACKENDS: dict[str, str] = {
    "nixl": "tandem.worker.kv.nixl:NixlTransport",
    "tcp": "tandem.worker.kv.tcp:TcpTransport",
    "memory": "tandem.worker.kv.memory:MemoryTransport",
}


def transport_class(name: str) -> type[KVTransport]:
    """The class registered under `name`; a helpful error for an unknown name or a missing package."""
    try:
        return resolve(BACKENDS, name, "KV transfer backend")
    except ImportError as e:
        raise ImportError(f"KV backend {name!r} needs a package that is not installed ({e}); "
                          "install nixl-cu12 (see the Makefile) or choose backend 'tcp'") from e


def create_transport(name: str, pool: torch.Tensor, layout: KVLayout, engine_id: str,
                     config: KVTransferConfig, leases: LeaseKeeper | None = None) -> KVTransport:
    """A transport of backend `name` over `pool`, serving and freeing the leases `leases` keeps (the
    engine; none: it serves nothing); call `await transport.start()` before use."""
    transport = transport_class(name)(pool, layout, engine_id, config)
    if leases is not None:
        transport.leases = leases
    return transport
