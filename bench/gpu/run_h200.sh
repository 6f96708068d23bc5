#!/usr/bin/env bash
# The GPU variant of `make bench`, for one H200: colocated vs disaggregated on a random-init
# Llama-3.1-8B shape in bf16 (built on the device, nothing downloaded). Prompts 2k-8k tokens,
# 128 output tokens. Writes OUTDIR/h200.json; budgeted to finish in under 8 minutes.
#   bench/gpu/run_h200.sh OUTDIR            (PYTHON=/path/to/python3 to pick the interpreter)
set -euo pipefail
OUTDIR=${1:?usage: bench/gpu/run_h200.sh OUTDIR}
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
echo "python: $($PYTHON --version 2>&1) at $(command -v "$PYTHON")"
if ! $PYTHON -c 'import torch' 2>/dev/null; then
  echo "ERROR: torch is not installed for $PYTHON. This script needs a CUDA build of torch (>= 2.1);"
  echo "       transformers is NOT needed. Set PYTHON=/path/to/python3 that has it."
  exit 2
fi
$PYTHON - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB")
try:
    import transformers
    print(f"transformers {transformers.__version__} (present, not needed)")
except ImportError:
    print("transformers: not installed (not needed)")
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
# 470 s hard stop: the budget inside stops starting repetitions at 400 s.
PYTHONUNBUFFERED=1 timeout 470 $PYTHON -m bench.gpu.h200 "$OUTDIR" "${@:2}" 2>&1 | tee "$OUTDIR/h200.log"
