"""A tensor-parallel rank of the transformers path reads only its share of the checkpoint into the
model's own classes (hf/rank_loading.py): each of its tensors equals the whole model's part the plan
gives that rank (heads, MLP rows, o/down columns, whole experts; the rest whole), the ranks' parts
together are the model, and it reads no byte it does not keep (another rank's experts never)."""

from __future__ import annotations

import pytest
import torch
from tandem.worker.engine.hf.rank_loading import load_rank_model
from tandem.worker.engine.hf.tensor_parallel import TensorParallelError, part_of, rank_splits
from tandem.worker.engine.parallel.group import GroupSpec, ParallelGroup

SIZE = 2


def rank(r: int, size: int = SIZE) -> ParallelGroup:
    """Rank r's group handle (building a rank's model needs no collective)."""
    return ParallelGroup(GroupSpec(size, r, "", 0), torch.device("cpu"))


def whole(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def load(path, group):
    from tandem.worker.engine.hf.paged_attention import register
    from transformers import AutoConfig

    return load_rank_model(path, AutoConfig.from_pretrained(path), torch.float32, torch.device("cpu"), group,
                           register())


def tensors(model) -> dict[str, torch.Tensor]:
    """A rank's tensors by the whole model's names (its wrappers' inner names folded away)."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name.replace(".linear.", ".").replace(".experts.experts.", ".experts.")] = t.detach()
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3_moe", "mixtral"])
def test_each_rank_holds_exactly_its_part_and_reads_nothing_else(tiny_model, arch):
    torch.set_num_threads(1)
    path = tiny_model(arch)
    full = whole(path)
    want = dict(full.named_parameters())
    split_bytes = []
    for r in range(SIZE):
        model, read = load(path, rank(r))
        got = tensors(model)
        splits = {s.name: s for s in rank_splits(full, rank(r))}
        held = 0
        for name, w in want.items():
            owner, _, param = name.rpartition(".")
            part = part_of(w.detach(), splits[owner], param) if owner in splits else w.detach()
            assert torch.equal(got[name], part), f"{arch} rank {r}: {name}"
            if name not in full._tied_weights_keys or not getattr(full.config, "tie_word_embeddings", False):
                held += part.numel() * part.element_size()
        assert read == held, f"{arch} rank {r} read {read} bytes, holds {held}"
        split_bytes.append(sum(got[n].numel() * 4 for n in want if n.rpartition(".")[0] in splits))
        for name, t in dict(full.named_buffers()).items():  # rotary frequencies, computed not read
            assert torch.equal(got[name], t), name
    whole_split = sum(w.numel() * 4 for n, w in want.items() if n.rpartition(".")[0] in splits)
    if arch != "mistral":  # its one KV head is replicated on both ranks; every other split halves
        assert sum(split_bytes) == whole_split
        assert split_bytes[0] == split_bytes[1] == whole_split // 2


def test_experts_another_rank_holds_are_never_read(tiny_model):
    from safetensors import safe_open

    path = tiny_model("qwen3_moe")
    _, read = load(path, rank(1))
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    experts = sum(torch.Size(s).numel() * 4 for k, s in sizes.items() if ".experts." in k)
    rest = sum(torch.Size(s).numel() * 4 for k, s in sizes.items() if ".experts." not in k)
    assert read < rest + experts // 2 + 1  # half the experts, at most all of the rest
    assert read > experts // 2


def test_a_plan_that_does_not_split_heads_is_refused_before_any_weight_is_read(tiny_model):
    with pytest.raises(TensorParallelError, match="does not split attention by heads"):
        load(tiny_model("phi3"), rank(0))


def test_an_untied_head_missing_from_the_checkpoint_is_refused(tiny_model, tmp_path):
    """A head tied to the embedding is not in the checkpoint and is not missed; an untied one (Qwen2's
    tiny model) that is missing would leave random weights: the rank refuses to load instead."""
    import shutil

    from safetensors.torch import load_file, save_file
    from tandem.worker.engine.errors import ModelLoadError

    src = tiny_model("qwen2")
    path = tmp_path / "headless"
    shutil.copytree(src, path)
    weights = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" in weights
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lm_head"):
        load(path, rank(0))
