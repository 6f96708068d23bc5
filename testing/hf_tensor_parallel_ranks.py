"""One rank of a tensor-parallel group running the transformers path, for the tests:

    python -m tandem.testing.hf_tensor_parallel_ranks --rank R --size N --port P --out FILE MODEL...

Every rank joins the group (rank 0 hosts the store at 127.0.0.1:P), then for each model in turn
loads it, splits it (hf/tensor_parallel.py) and builds its runner over a pool of its heads, its
decode step compiled (hf/decode_graph.py: the group's collectives inside the graph). Rank 0
builds an Engine whose runner drives the group, serves the prompts in FILE's "prompts" (batched,
prefilled in chunks, then again from the prefix cache) and writes each model's greedy outputs
to FILE; the other ranks follow rank 0's steps until it stops the group for that model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BLOCKS, BLOCK_SIZE, NEW_TOKENS = 96, 4, 10


def engine_config(model: str):
    from tandem.worker.engine.config import EngineConfig

    return EngineConfig(model=model, num_blocks=BLOCKS, block_size=BLOCK_SIZE, max_batched_tokens=64,
                        max_num_seqs=4, prefill_chunk_tokens=7, compile="on", model_backend="transformers")


def lead(model: str, group, prompts: list[list[int]]) -> list[list[int]]:
    from tandem.testing.engine_helpers import greedy, run_to_completion, submit, tokens_of
    from tandem.worker.engine.engine import Engine
    from tandem.worker.engine.loader import load_model

    lm = load_model(model, dtype="float32", device="cpu", backend="transformers", tensor_parallel=group.size, group=group)
    eng = Engine(engine_config(model), loaded=lm)
    try:
        outs = []
        for tag in ("first", "cached"):  # the second round starts from the prefix cache
            sinks = [submit(eng, f"{tag}{i}", ids, greedy(NEW_TOKENS)) for i, ids in enumerate(prompts)]
            run_to_completion(eng)
            outs += [tokens_of(s) for s in sinks]
        assert eng.prefix_cache.stats.hit_tokens_total > 0
        return outs
    finally:
        eng.runner.close()


def follow_model(model: str, group) -> None:
    import torch
    from tandem.worker.engine.loader import load_model
    from tandem.worker.engine.model_runner import rank_runner
    from tandem.worker.engine.parallel.executor import follow
    from tandem.worker.engine.pool_sizing import kv_layout_for

    lm = load_model(model, dtype="float32", device="cpu", backend="transformers", tensor_parallel=group.size, group=group)
    layout = kv_layout_for(lm.config, BLOCKS, BLOCK_SIZE, lm.dtype, group)
    runner, _ = rank_runner(lm, torch.zeros(layout.shape, dtype=lm.dtype), layout, "on", BLOCKS * BLOCK_SIZE)
    follow(group, runner)


def main() -> int:
    import faulthandler

    import torch

    faulthandler.enable()  # a rank that aborts prints every thread's Python stack
    from tandem.worker.engine.parallel.group import GroupSpec, ParallelGroup, make_store

    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = GroupSpec(args.size, args.rank, "127.0.0.1", args.port, timeout_s=120.0, startup_s=300.0)
    group = ParallelGroup.join(spec, torch.device("cpu"), make_store(spec))
    try:
        if args.rank:
            for model in args.models:
                follow_model(model, group)
            return 0
        prompts = json.loads(args.out.read_text())["prompts"]
        results = {model: lead(model, group, prompts) for model in args.models}
        args.out.write_text(json.dumps({"prompts": prompts, "outputs": results}))
        return 0
    finally:
        group.close()


if __name__ == "__main__":
    from tandem.worker.engine.parallel.group import leave_process

    leave_process(main())  # as a worker's follower rank leaves: no finalising of the group's threads
