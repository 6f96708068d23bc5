"""What one replica can do, for the autoscaling simulator: prefill time by prompt length and decode
step time by batch size, Tandem's engine in-process on one pinned core (tandem.planning.calibrate).

    python -m bench calibrate [--repeats 2] [--merge bench/simulator/capacity_cpu.json]

The fit also goes to --calibration (the simulator's input, bench/simulator/capacity_cpu.json) unless
--no-install. The machine is shared: run it when it is quiet, and read the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench.simulator.capacity import CALIBRATION


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--calibration", type=Path, default=CALIBRATION, help="where the simulator reads the fit")
    ap.add_argument("--no-install", action="store_true", help="leave --calibration as it is")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding sequence")
    ap.add_argument("--decode-steps", type=int, default=8, help="steps at each batch size")
    ap.add_argument("--merge", default=None,
                    help="an earlier output: keep the least time per point over both runs (noise only adds)")
    ap.add_argument("--core", type=int, default=None, help="pin to this core (default: the last one)")


def run(args: argparse.Namespace) -> dict:
    from tandem.planning.calibrate import measure_pinned, merge
    from tandem.worker.local.toy_model import make_toy_model

    from bench.lib.models import MULTITURN_MODEL

    core = args.core if args.core is not None else (os.cpu_count() or 1) - 1
    model_dir = make_toy_model(Path(tempfile.gettempdir()) / "tandem-sim-calibrate", **MULTITURN_MODEL)
    result = measure_pinned(model_dir, {core}, 1, dtype="float32", repeats=args.repeats, context=args.context,
                            decode_steps=args.decode_steps, say=lambda line: print(line, flush=True))
    if args.merge:
        result = merge(json.loads(Path(args.merge).read_text()), result)
    result |= {"runs": result.get("runs", 1), "model": MULTITURN_MODEL}
    fit = result["fit"]
    print(f"fit: prefill {fit['prefill_tokens_per_s']:.0f} tokens/s + {fit['prefill_overhead_s'] * 1e3:.0f} ms; "
          f"decode step {fit['decode_step_base_s'] * 1e3:.1f} ms + {fit['decode_step_per_seq_s'] * 1e3:.2f} ms "
          f"per sequence")
    if not args.no_install:
        args.calibration.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.calibration}")
    return result
