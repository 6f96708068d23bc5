#!/usr/bin/env bash
# Issue 29 on one GPU: issue 13's interference load (one repetition of 40 requests) and the curves
# (the reduced grid) for Tandem's own engine (gpu-disagg-bf16: a prefill and a decode worker sharing
# the device, KV over NIXL; gpu-colo-bf16: one colocated worker), then, when VLLM names a GPU build's
# `vllm`, for plain vLLM colocated (vllm-bf16) against Tandem on vLLM disaggregated
# (tandem-vllm-disagg-bf16: its prefill and decode servers split the device, 0.4 of its memory each,
# and are pinned to cores 0 and 1 as on the CPU). The bench's 42M random-init Llama, nothing
# downloaded: the ratios show the serving paths, not a large model's speed. Results in
# OUTDIR/<scenario>/<run-id>.json, logs in OUTDIR/*.log; BENCHMARKS.md is not touched.
#   bench/gpu/run_vllm.sh OUTDIR     (PYTHON: an env with `pip install .[worker]` and nixl-cu12;
#                                     VLLM=/path/to/vllm: without it the vLLM arms are left out)
set -euo pipefail
OUTDIR=${1:?usage: bench/gpu/run_vllm.sh OUTDIR}
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
run() {  # scenario, wall limit (s), options...: a failed or cut scenario does not stop the next
  PYTHONUNBUFFERED=1 timeout "$2" "$PYTHON" -m bench "$1" --results-dir "$OUTDIR" "${@:3}" 2>&1 \
    | tee -a "$OUTDIR/$1.log" || echo "bench $1 failed or was cut at $2 s"
}
I=(--reps 1 --profile --no-markdown)
C=(--grid reduced --no-markdown --no-figure)
run interference 240 --arms gpu-disagg-bf16 gpu-colo-bf16 "${I[@]}"
run curves 240 --arms gpu-disagg-bf16 gpu-colo-bf16 "${C[@]}"
if [ -n "${VLLM:-}" ]; then
  export TANDEM_VLLM=$VLLM  # the peer's `vllm serve` and Tandem's launcher both run it
  W=(--worker-arg=--vllm-arg=--gpu-memory-utilization=0.4)
  run interference 420 --arms tandem-vllm-disagg-bf16 vllm-bf16 "${I[@]}" "${W[@]}"
  run curves 420 --arms tandem-vllm-disagg-bf16 vllm-bf16 "${C[@]}" "${W[@]}"
else
  echo "VLLM unset: the vLLM arms are left out"
fi
