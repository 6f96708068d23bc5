"""A plan as the InferenceService fields to apply (YAML under `spec:`), with the figures behind it
as comments above. Pure: the caller prints it."""

from __future__ import annotations

from typing import Any

import yaml
from tandem.planning.capacity import Capacity
from tandem.planning.predict import Fleet, Prediction
from tandem.planning.recommend import Plan, Sized
from tandem.planning.workload import Workload


def _s(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def spec_fields(plan: Plan, autoscaling: bool = False) -> dict[str, Any]:
    """The `spec` fields the plan sets (prefill, decode, and optionally autoscaling)."""
    fleet = plan.chosen.fleet
    if fleet is None:
        return {}
    decode: dict[str, Any] = {"replicas": fleet.decode}
    if fleet.decode_chunk:
        decode["engine"] = {"prefillChunkTokens": fleet.decode_chunk}
    spec: dict[str, Any] = {"prefill": {"replicas": fleet.prefill}, "decode": decode}
    if autoscaling:
        wl = plan.workload
        spec["autoscaling"] = {
            "targets": {name: {"seconds": t.seconds, "percentile": _number(t.percentile)}
                        for name, t in (("ttft", wl.ttft), ("itl", wl.itl))},
            "prefill": {"minReplicas": 0, "maxReplicas": max(1, 2 * fleet.prefill)},
            "decode": {"minReplicas": 1, "maxReplicas": 2 * fleet.decode},
        }
    return spec


def _number(x: float) -> float | int:
    return int(x) if x == int(x) else x


def prediction_line(p: Prediction, wl: Workload) -> str:
    busy = f"; prefill workers {p.prefill_busy:.0%} busy" if p.prefill_busy else ""
    return (f"TTFT p50 {_s(p.ttft_p50)}, p{wl.ttft.percentile:g} {_s(p.ttft_q)}; ITL p50 {_s(p.itl_p50)}, "
            f"p{wl.itl.percentile:g} {_s(p.itl_q)}; {p.tokens_per_s:.0f} output tokens/s{busy}")


def capacity_line(cap: Capacity) -> str:
    top = cap.decode_batches[-1]
    return (f"one worker prefills {cap.prefill_tokens_per_s:,.0f} tokens/s (+{_s(cap.prefill_overhead_s)} a step); "
            f"a decode step takes {_s(cap.step_s(1))} at 1 sequence, {_s(cap.step_s(top))} at {top}")


def sized_lines(s: Sized, plan: Plan) -> list[str]:
    if s.fleet is None or s.prediction is None:
        return [f"{s.layout}: {s.problem}"]
    head = f"{s.layout}: {s.fleet.describe()}" + (f": {s.problem}" if s.problem else "")
    return [head, f"  predicted: {prediction_line(s.prediction, plan.workload)} ({s.prediction.requests} simulated requests)"]


def render(plan: Plan, cap: Capacity, source: str, autoscaling: bool = False) -> str:
    """The plan as YAML with comments: the workload, the capacity, each layout's fleet and prediction."""
    lines = [f"tandem plan: {plan.workload.describe()}", f"capacity ({source}): {capacity_line(cap)}",
             f"a decode worker holds {plan.seats} sequences within the ITL target"]
    chosen = plan.chosen
    lines.append(f"recommended: {plan.why}")
    if chosen.fleet is not None:
        lines += sized_lines(chosen, plan)
    for other in plan.others:
        lines += sized_lines(other, plan)
    text = "".join(f"# {line}\n" for line in lines)
    fields = spec_fields(plan, autoscaling)
    if not fields:
        return text + "# nothing to apply: no fleet meets the targets\n"
    return text + yaml.safe_dump({"spec": fields}, sort_keys=False)


def fleet_report(fleet: Fleet, p: Prediction, wl: Workload) -> str:
    """One given fleet's prediction (`tandem plan --fleet`), to set beside a measured run."""
    return (f"# tandem plan: {wl.describe()}\n# {fleet.layout}: {fleet.describe()}\n"
            f"# predicted: {prediction_line(p, wl)} ({p.requests} simulated requests)\n")
