"""A tiny random-weight Llama model saved in Hugging Face format: what `tandem up` serves by
default, and what the tests and benchmarks load.

No model can be downloaded here, so the tests build their own: a `LlamaForCausalLM` with fixed
seeded weights (scaled so greedy decoding is neither one repeated token nor a string of near-ties)
and a byte-level BPE tokenizer trained deterministically on a built-in corpus, with a chat template.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

MARKER = ".tandem-toy-complete"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Enough varied English (plus a few non-ASCII words, to exercise partial UTF-8) for a few hundred merges.
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Prefill reads the whole prompt at once; decode writes one token at a time.",
    "A paged key value cache keeps fixed size blocks in one pool allocated at start up.",
    "Kubernetes schedules pods onto nodes, and an operator reconciles what it observes.",
    "Once upon a time there was a little model that wanted to speak every language.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 and 3.14159 appear in text too.",
    "Hello, world! How are you today? I am fine, thank you, and you?",
    "Café, naïve, über, smörgåsbord, 東京, こんにちは, and emoji like 🚀 are UTF-8 too.",
    "The router sends the prompt to a prefill worker and streams tokens from a decode worker.",
    "Continuous batching lets sequences join and leave the running batch at every step.",
    "In the beginning the engine loads weights, then it serves requests until it is stopped.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "user assistant system: answer the question briefly and clearly, please.",
] * 4


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def _build_tokenizer(vocab_size: int):
    """Byte-level BPE trained on CORPUS, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1 << 30
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def toy_tokenizer():
    """The toy models' tokenizer (byte-level BPE with a chat template), for a model built elsewhere
    (the GPU benchmark draws its weights on the device)."""
    return _build_tokenizer(512)


def make_toy_model(
    path: str | os.PathLike,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> Path:
    """Create (once) a random Llama model + tokenizer folder at `path` and return it.

    `vocab_size` may exceed what the tokenizer learns from its small corpus (a few hundred
    tokens): the model then has the larger embedding and output head (the cost of a real
    vocabulary) and the ids past the tokenizer's decode to no text. `tie_word_embeddings` shares
    the embedding with the output head, as small Llamas do.

    Idempotent and safe under concurrent callers: it is built in a temporary sibling folder and
    renamed into place, so nobody sees half a model.
    """
    path = Path(path)
    if _is_complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        _save_llama(tmp, seed=seed, num_hidden_layers=num_layers, hidden_size=hidden_size,
                    num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                    intermediate_size=intermediate_size, vocab_size=vocab_size,
                    max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings)
        _move_into_place(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path



def _save_llama(folder: Path, *, seed: int, vocab_size: int, **shape: Any) -> None:
    """A random-weight LlamaForCausalLM of `shape` (LlamaConfig's names), its generation config,
    tokenizer and completion marker, written into `folder`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Larger than Llama's 0.02 so logits spread out: no near-ties, varied greedy output.
        initializer_range=0.15,
        **shape,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / MARKER).write_text(json.dumps({"seed": seed, "num_layers": shape["num_hidden_layers"],
                                             "tied": shape["tie_word_embeddings"]}))


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished folder to `path` at once; a racing builder's complete model there is as good."""
    try:
        os.rename(tmp, path)  # atomic; also replaces an empty existing folder
    except OSError:
        if not _is_complete(path):
            raise RuntimeError(
                f"{path} exists and is not a complete toy model; remove it or pick another path"
            ) from None


if __name__ == "__main__":
    import sys

    print(make_toy_model(sys.argv[1] if len(sys.argv) > 1 else "toy-model"))
