"""Chooses the worker client of the configured runtime by name and imports it only then (the shape
of vLLM's kv_connector factory and of policies/registry.py): a name maps to "module:factory", and a
factory takes the router's HTTP session and configuration and returns a `WorkerClient`
(worker_client.py, where each method says what a runtime must provide). `RouterConfig.runtime` is
checked against these names when the config loads. A new runtime is one module with a factory and
one line here; nothing else in the router changes (docs/request-lifecycle.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tandem.contracts.lazy_registry import check_name, resolve
from tandem.contracts.runtimes import Runtime

if TYPE_CHECKING:
    import aiohttp
    from tandem.router.config import RouterConfig
    from tandem.router.worker_client import WorkerClient


class ClientFactory(Protocol):
    def __call__(self, session: aiohttp.ClientSession, config: RouterConfig) -> WorkerClient: ...


# Every name in tandem.contracts.runtimes.Runtime.
RUNTIMES: dict[str, str] = {
    Runtime.TANDEM: "tandem.router.runtimes.tandem:create_client",
    Runtime.VLLM: "tandem.router.runtimes.vllm:create_client",
}


def check_runtime(name: str) -> None:
    """Raise ValueError naming the known runtimes when `name` is not one of them."""
    check_name(RUNTIMES, name, "runtime")


def client_factory(name: str) -> ClientFactory:
    return resolve(RUNTIMES, name, "runtime")


def create_client(session: aiohttp.ClientSession, config: RouterConfig) -> WorkerClient:
    """The worker client of `config.runtime`, sharing `session`."""
    return client_factory(config.runtime)(session, config)
