"""Which engine the workers run: `spec.runtime` (Tandem's own, or vLLM). Pure declarations.

`runtime.args` are extra `vllm serve` flags. What Tandem sets itself (the model, the ports, the KV
connector, the parallelism: tandem.contracts.vllm_serve.TANDEM_FLAGS, the one list) is refused at
`kubectl apply` by CEL rules written from that list, each collision named with why; the parser
enforces the same through colliding_args, the contract's own check, so a CRD older than the
operator cannot let one through. docs/runtimes.md says which runtime to choose.
"""

from __future__ import annotations

from typing import ClassVar

from tandem.contracts.runtimes import DEFAULT_RUNTIME, Runtime
from tandem.contracts.vllm_serve import TANDEM_FLAGS, colliding_args
from tandem.operator.spec.fields import Rule, api_field
from tandem.operator.spec.model import api_type
from tandem.operator.spec.pod import Image

MAX_ARGS = 32
MAX_ARG_LENGTH = 256  # bounds the CEL rules' cost: every arg is checked against every flag


def _sets_flag(problem: str) -> bool:
    return problem.split(": ", 1)[0] in TANDEM_FLAGS


def flag_collisions(args: tuple[str, ...] | None) -> list[str]:
    """The args that set a flag Tandem sets, each with why (contracts.vllm_serve.colliding_args)."""
    return [p for p in colliding_args(list(args or ())) if _sets_flag(p)]


def positional_args(args: tuple[str, ...] | None) -> list[str]:
    """The args vLLM would take as positional (the model): colliding_args's other finding."""
    return [p for p in colliding_args(list(args or ())) if not _sets_flag(p)]


def _flag_rule(flags: tuple[str, ...], why: str) -> Rule:
    """One rule per reason in TANDEM_FLAGS (its spellings together), so `kubectl apply` names each
    flag with why; `--flag value` and `--flag=value` both caught. (One rule naming them all through a
    messageExpression costs more than the API server's CEL budget allows.)"""
    sets = " || ".join(f"a == '{f}' || a.startsWith('{f}=')" for f in flags)
    return Rule(f"!has(self.args) || !self.args.exists(a, {sets})",
                f"runtime.args may not set {' or '.join(flags)}: {why} (Tandem sets it itself)",
                check=lambda r: not any(a.split("=", 1)[0] in flags for a in r.args or ()))


def _flag_rules() -> tuple[Rule, ...]:
    by_reason: dict[str, list[str]] = {}
    for flag, why in TANDEM_FLAGS.items():
        by_reason.setdefault(why, []).append(flag)
    return tuple(_flag_rule(tuple(flags), why) for why, flags in by_reason.items())


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
        *_flag_rules(),
        ARGS_POSITIONAL,
    )
