"""add_generation_prompt, continue_final_message and chat_template_kwargs render the same token ids
in the router (its own Jinja) as in the workers (transformers' apply_chat_template, through the
engine's tokenize), with the toy model's template and one that reads a template variable."""

from __future__ import annotations

import pytest
from tandem.contracts.protocol import GenerateRequest
from tandem.router.tokenizer import RouterTokenizer
from tandem.worker.engine.request_checks import tokenize

STYLED = ("{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
          "{% if style %}[{{ style }}]{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n"
          "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moon, and"}]
OPTIONS = [None, {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True},
           {"chat_template_kwargs": {"style": "brief"}},
           {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}]


@pytest.fixture(scope="module", params=["toy", "styled"])
def both(request, toy_model_dir, tmp_path_factory):
    import shutil

    from transformers import AutoTokenizer

    path = toy_model_dir
    if request.param == "styled":
        path = tmp_path_factory.mktemp("styled")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(toy_model_dir / f, path / f)
        (path / "chat_template.jinja").write_text(STYLED)
    return RouterTokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("options", OPTIONS)
def test_router_and_worker_render_the_same_ids(both, options):
    router, hf = both
    want = tokenize(hf, GenerateRequest("r", messages=CHAT, chat_options=options), 512)
    assert router.encode_chat(CHAT, options) == want


def test_continue_final_message_leaves_the_last_message_open(both):
    router, _ = both
    text = router.render_chat(CHAT, {"add_generation_prompt": False, "continue_final_message": True})
    assert text.endswith("Autumn moon, and")
    assert router.render_chat(CHAT, {"add_generation_prompt": False}).endswith("Autumn moon, and\n")


def test_template_kwargs_reach_the_template(both, request):
    router, _ = both
    styled = router.render_chat(CHAT, {"chat_template_kwargs": {"style": "brief"}})
    reads_style = "styled" in request.node.callspec.id
    assert ("[brief]" in styled) is reads_style
    assert "[brief]" not in router.render_chat(CHAT)
