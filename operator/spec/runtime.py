"""Which engine the workers run: `spec.runtime` (Tandem's own, or vLLM). Pure declarations.

`runtime.args` are extra `vllm serve` flags. What Tandem sets itself (the model, the ports, the KV
connector, the parallelism: tandem.contracts.vllm_serve.TANDEM_FLAGS, the one list) is refused at
`kubectl apply` by CEL rules written from that list, each collision named with why; the parser
enforces the same through colliding_args, the contract's own check, so a CRD older than the
operator cannot let one through. docs/runtimes.md says which runtime to choose.
"""

from __future__ import annotations

import json
from typing import ClassVar

from tandem.contracts.runtimes import DEFAULT_RUNTIME, Runtime
from tandem.contracts.vllm_serve import TANDEM_FLAGS, colliding_args
from tandem.operator.spec.fields import Rule, api_field
from tandem.operator.spec.model import api_type
from tandem.operator.spec.pod import Image

MAX_ARGS = 64
MAX_ARG_LENGTH = 1024


def _cel(text: str) -> str:
    """A CEL string literal (double-quoted: the reasons hold apostrophes)."""
    return json.dumps(text)


_FLAGS = "[" + ", ".join(_cel(f) for f in TANDEM_FLAGS) + "]"
_REASONS = "{" + ", ".join(f"{_cel(f)}: {_cel(why)}" for f, why in TANDEM_FLAGS.items()) + "}"
_SETS = f"{_FLAGS}.exists(f, a == f || a.startsWith(f + '='))"


def _sets_flag(problem: str) -> bool:
    return problem.split(": ", 1)[0] in TANDEM_FLAGS


def flag_collisions(args: tuple[str, ...] | None) -> list[str]:
    """The args that set a flag Tandem sets, each with why (contracts.vllm_serve.colliding_args)."""
    return [p for p in colliding_args(list(args or ())) if _sets_flag(p)]


def positional_args(args: tuple[str, ...] | None) -> list[str]:
    """The args vLLM would take as positional (the model): colliding_args's other finding."""
    return [p for p in colliding_args(list(args or ())) if not _sets_flag(p)]


# Every flag of TANDEM_FLAGS, with `--flag value` and `--flag=value` both caught.
ARGS_COLLIDE = Rule(
    f"!has(self.args) || self.args.all(a, !{_SETS})",
    "runtime.args may not set what Tandem sets itself: " + ", ".join(TANDEM_FLAGS)
    + " (the model, ports, KV connector, parallelism and group launch come from the spec)",
    check=lambda r: not flag_collisions(r.args),
    message_expression=(
        "'runtime.args may not set what Tandem sets itself: ' + self.args.filter(a, " + _SETS + ")"
        f".map(a, a.split('=')[0] + ' (' + {_REASONS}[a.split('=')[0]] + ')').join('; ')"),
    explain=lambda r: "runtime.args may not set what Tandem sets itself: " + "; ".join(flag_collisions(r.args)))
# vLLM takes a bare word as the model; a value follows a flag written without '='.
ARGS_POSITIONAL = Rule(
    "!has(self.args) || self.args.all(i, a, a.startsWith('-') || "
    "(i > 0 && self.args[i - 1].startsWith('-') && !self.args[i - 1].contains('=')))",
    "runtime.args may hold only flags and their values: a bare word would be vLLM's model, which comes from "
    "spec.model",
    check=lambda r: not positional_args(r.args),
    explain=lambda r: "runtime.args may hold only flags and their values (the model comes from spec.model): "
    + "; ".join(positional_args(r.args)))


@api_type
class RuntimeSpec:
    """The engine prefill and decode run: Tandem's own worker, or vLLM's OpenAI server paired by its
    NixlConnector (docs/runtimes.md)."""

    name: Runtime = api_field(
        "name", default=DEFAULT_RUNTIME.value,
        description="tandem: Tandem's own engine (CPUs, development, decode-to-decode migration). vllm: vLLM's "
        "server per worker (`tandem worker --runtime vllm` launching `vllm serve`), KV handed over by vLLM's "
        "NixlConnector, behind Tandem's router.")
    image: Image | None = api_field(
        "image", description="The vLLM worker image (Tandem's worker image with vLLM: the Dockerfile's vllm "
        "target); unset fields come from the operator's vLLM image (--vllm-image). Runtime vllm only: "
        "Tandem's own worker image is spec.image.")
    args: tuple[str, ...] | None = api_field(
        "args", max_items=MAX_ARGS, values={"maxLength": MAX_ARG_LENGTH},
        description="Extra `vllm serve` flags for prefill and decode, after Tandem's (e.g. --enforce-eager, "
        "--kv-cache-dtype fp8, --gpu-memory-utilization 0.85). Refused: what Tandem sets itself (" +
        ", ".join(TANDEM_FLAGS) + ") and bare words. Runtime vllm only.")

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("self.name == 'vllm' || !has(self.args) || size(self.args) == 0",
             "runtime.args are vllm serve flags: they apply to runtime vllm only (Tandem's own worker takes its "
             "settings from the spec's fields)",
             check=lambda r: r.name is Runtime.VLLM or not r.args),
        Rule("self.name == 'vllm' || !has(self.image)",
             "runtime.image applies to runtime vllm only: Tandem's own worker image is spec.image",
             check=lambda r: r.name is Runtime.VLLM or r.image is None),
        ARGS_COLLIDE,
        ARGS_POSITIONAL,
    )
