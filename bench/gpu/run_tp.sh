#!/usr/bin/env bash
# The tensor-parallel arms on GPUs: step time at each tensor size that fits the GPUs present (one
# rank per GPU, NCCL between them; a size above the GPU count is skipped and says so), and the KV
# handoff between prefill and decode of each (p, d) over NIXL from VRAM to VRAM
# (python -m bench tensor_parallel --device cuda). The engine scenarios' ~42M Llama in fp32: the
# figures show the collectives' and the handoff's mechanics, not a large model's speed.
#   bench/gpu/run_tp.sh OUTDIR [--tp 1,2,4,8] [--pairs 1-2,2-1,2-2]
#                              (PYTHON=/path/to/python3: an env with `pip install .[worker]` and nixl-cu12)
set -euo pipefail
OUTDIR=${1:?usage: bench/gpu/run_tp.sh OUTDIR [tensor_parallel options]}
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
GPUS=$($PYTHON -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $GPUS"
if [ "$GPUS" -lt 1 ]; then
  echo "ERROR: no CUDA device: run bench/scenarios/tensor_parallel.py on the CPU instead."
  exit 2
fi
[ "$GPUS" -lt 2 ] && echo "note: one GPU: TP 1 only; every size above 1 is skipped (NCCL needs a GPU per rank)"
PYTHONUNBUFFERED=1 timeout 540 $PYTHON -m bench tensor_parallel --device cuda --backends nixl \
  --results-dir "$OUTDIR" "${@:2}" 2>&1 | tee "$OUTDIR/tensor_parallel.log"
