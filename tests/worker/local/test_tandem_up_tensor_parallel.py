"""`tandem up --tp / --prefill-tp / --decode-tp`: workers of several ranks, each rank a process, the
OpenAI API answered through them as through one-rank workers, and no rank left behind."""

from __future__ import annotations

import argparse

import psutil
import pytest
import torch
from tandem.testing.engine_helpers import reference_generate
from tandem.testing.local_stack import LocalStack
from tandem.worker.local import up


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    return p.parse_args(list(argv))


def _tp(child) -> int:
    return int(child.argv[child.argv.index("--tensor-parallel") + 1]) if "--tensor-parallel" in child.argv else 1


def test_each_role_gets_its_tensor_size(tmp_path):
    children = up.processes(_args("--prefill-tp", "2", "--decode", "2", "--pin-cpus"), tmp_path)
    assert [(c.name, _tp(c)) for c in children[:3]] == [("prefill-0", 2), ("decode-0", 1), ("decode-1", 1)]
    assert children[0].cpu is None and children[1].cpu is not None  # a worker of two ranks needs two cores
    both = up.processes(_args("--tp", "2", "--decode-tp", "4"), tmp_path)
    assert [_tp(c) for c in both[:2]] == [2, 4]
    colocated = up.processes(_args("--mode", "colocated", "--tp", "2"), tmp_path)
    assert _tp(colocated[0]) == 2 and "--tensor-parallel" not in colocated[-1].argv  # not the router


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_disaggregated_stack_with_different_tensor_sizes_answers_like_transformers(toy_model_dir):
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stack = LocalStack(toy_model_dir, "disaggregated", ["--prefill-tp", "2", "--decode-tp", "1", "--kv-backend",
                                                        "tcp", "--short-prompt-threshold", "0",
                                                        "--worker-arg=--compile=off"], startup_timeout_s=600).start()
    try:
        ranks = [c for w in stack.workers() for c in psutil.Process(w["pid"]).children()]
        assert len(ranks) == 1  # the prefill worker's rank 1
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused")
        prompt = "The router sends the prompt to a prefill worker and streams tokens"
        got = client.completions.create(model="toy-llama", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        tok = AutoTokenizer.from_pretrained(toy_model_dir)
        hf = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
        want = reference_generate(hf, tok(prompt)["input_ids"], 12)
        assert got.choices[0].text == tok.decode(want, skip_special_tokens=True)
        prefill = stack.info(stack.workers("prefill")[0]["url"])
        assert prefill["tensor_parallel"] == 2 and len(prefill["ranks"]) == 1
    finally:
        stack.stop()
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"ranks left behind: {alive}"
