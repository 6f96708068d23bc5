#!/usr/bin/env bash
# The GPU benchmark, for one H200: Tandem's own workers and router, colocated against disaggregated,
# and the engine's CUDA parity (python -m bench gpu), then the decode step against the HBM bound
# (python -m bench engine_decode --device cuda). A random-init Llama-3.1-8B shape in bf16 is built
# on the device once, in OUTDIR/model (nothing downloaded). The results go to
# OUTDIR/{gpu,engine_decode}/<run-id>.json, logs to OUTDIR/*.log.
#   bench/gpu/run_h200.sh OUTDIR            (PYTHON=/path/to/python3: an env with `pip install .[worker]`
#                                            and nixl-cu12, i.e. what `make venv` builds)
set -euo pipefail
OUTDIR=${1:?usage: bench/gpu/run_h200.sh OUTDIR}
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
echo "python: $($PYTHON --version 2>&1) at $(command -v "$PYTHON")"
if ! $PYTHON -c 'import torch, tandem.worker.engine.engine' 2>/dev/null; then
  echo "ERROR: $PYTHON cannot import torch and Tandem's engine: run from a venv with .[worker] installed."
  exit 2
fi
$PYTHON - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB")
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
# Hard stops well inside a 10-minute device slot: Tandem's arms first (the headline), then the engine.
PYTHONUNBUFFERED=1 timeout 420 $PYTHON -m bench gpu --model-dir "$OUTDIR/model" --results-dir "$OUTDIR" "${@:2}" \
  2>&1 | tee "$OUTDIR/gpu.log"
PYTHONUNBUFFERED=1 timeout 150 $PYTHON -m bench engine_decode --device cuda --model-dir "$OUTDIR/model" \
  --dtypes bfloat16 --batches 1,8,32 --prompt-len 256 --new-tokens 32 --reps 2 --results-dir "$OUTDIR" \
  2>&1 | tee "$OUTDIR/engine_decode.log"
