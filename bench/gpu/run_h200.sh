#!/usr/bin/env bash
# The GPU benchmark, for one H200 (python -m bench gpu): Tandem's own workers and router, colocated
# against disaggregated, then the engine's CUDA parity and decode step against the HBM bound. A
# random-init Llama-3.1-8B shape in bf16 is built on the device (nothing downloaded). The result
# goes to OUTDIR/gpu/<run-id>.json, the log to OUTDIR/gpu.log.
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
# A hard stop inside a 10-minute device slot: Tandem's arms first (the headline), then the engine.
PYTHONUNBUFFERED=1 timeout 570 $PYTHON -m bench gpu --results-dir "$OUTDIR" "${@:2}" 2>&1 | tee "$OUTDIR/gpu.log"
