"""The router's tokenizer (tokenizers + a sandboxed Jinja chat template, no torch, no transformers)
gives exactly the token ids the workers' `transformers` tokenizer gives, for prompts and chat messages."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tandem.contracts.prefix import block_hashes
from tandem.router.tokenizer import ChatTemplateError, RouterTokenizer

PROMPTS = [
    "Hello, world!",
    "",
    "  leading spaces and trailing   ",
    "Café, naïve, 東京, こんにちは and 🚀 are UTF-8 too.",
    "text with a special token </s> inside and <s> too",
    "line one\nline two\n\n\ttabbed",
    "The router sends the prompt to a prefill worker. " * 40,
]

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And 東京?"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "a </s> b <|user|>"}],
]


@pytest.fixture(scope="module")
def both(toy_model_dir):
    from transformers import AutoTokenizer

    return RouterTokenizer.from_dir(toy_model_dir), AutoTokenizer.from_pretrained(toy_model_dir)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_ids_equal_the_workers(both, prompt):
    router, hf = both
    assert router.encode_prompt(prompt) == list(hf(prompt)["input_ids"])


@pytest.mark.parametrize("messages", CHATS)
def test_chat_ids_equal_the_workers(both, messages):
    router, hf = both
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert router.encode_chat(messages) == list(want["input_ids"])


def test_block_hashes_equal_for_equal_prefixes(both):
    router, _ = both
    first = [{"role": "user", "content": "The router sends the prompt to a prefill worker. " * 10}]
    later = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    a, b = (block_hashes(router.encode_chat(m), 16) for m in (first, later))
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    assert shared >= len(a) - 1  # the whole earlier turn, but perhaps its last block, is shared


def test_a_template_error_is_a_client_error(toy_model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((toy_model_dir / name).read_text())
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{% endif %}{{ messages[0]['content'] }}")
    tok = RouterTokenizer.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tok.encode_chat([{"role": "system", "content": "x"}])
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match="no chat template"):
        RouterTokenizer.from_dir(tmp_path).encode_chat([{"role": "user", "content": "x"}])


def test_the_sandbox_refuses_escapes(toy_model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((toy_model_dir / name).read_text())
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        RouterTokenizer.from_dir(tmp_path).encode_chat([{"role": "user", "content": "x"}])


def test_the_tokenizer_module_loads_neither_torch_nor_transformers(toy_model_dir):
    code = (
        "import sys\n"
        "from tandem.router.tokenizer import RouterTokenizer\n"
        f"RouterTokenizer.from_dir({str(toy_model_dir)!r}).encode_chat([{{'role': 'user', 'content': 'x'}}])\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
