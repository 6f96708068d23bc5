"""The runtimes an InferenceService's workers may run, named once for the operator (which renders a
role through one renderer per runtime, tandem.operator.render.runtimes) and the router (which
reaches workers through one client per runtime, tandem.router.runtimes). docs/request-lifecycle.md
shows where each plugs in. `spec.runtime.name` names one of these."""

from __future__ import annotations

import enum


class Runtime(enum.StrEnum):
    TANDEM = "tandem"  # Tandem's own engine and worker protocol (tandem.contracts.protocol)
    VLLM = "vllm"  # vLLM's OpenAI server, P/D over its NixlConnector (tandem.contracts.vllm_serve)


DEFAULT_RUNTIME = Runtime.TANDEM
