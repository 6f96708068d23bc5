"""GET /internal/tokenizer on a real in-process worker: the files load in the router's tokenizer
(no torch) and encode prompts and chat messages exactly as the worker's engine does; their digest
is what /internal/info reports; 503 before the model is loaded; the secret is required."""

from __future__ import annotations

import asyncio
import time

import pytest
from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.tokenizer_files import TokenizerFiles, tokenizer_digest
from tandem.router.tokenizer import RouterTokenizer

SECRET = "tokenizer-route-secret-0123456789"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café 東京 </s> ok?"}]


async def info_digest(w, within_s: float = 30.0) -> str:
    """/internal/info's tokenizer_sha256, once the worker has exported its tokenizer."""
    deadline = time.monotonic() + within_s
    while True:
        resp = await w.client.get("/internal/info", headers=w.auth)
        digest = (await resp.json())["tokenizer_sha256"]
        if digest or time.monotonic() > deadline:
            return digest
        await asyncio.sleep(0.05)


async def test_the_served_files_tokenize_like_the_worker(start_worker):
    w = await start_worker(role="colocated", secret=SECRET)
    resp = await w.client.get("/internal/tokenizer", headers=w.auth)
    assert resp.status == 200, await resp.text()
    served = TokenizerFiles.from_dict(await resp.json())  # checks the digest against the files
    assert set(served.files) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert resp.headers["ETag"] == f'"{served.sha256}"'
    assert await info_digest(w) == served.sha256
    router = RouterTokenizer.from_files(served.files)
    for prompt in ("Hello, world!", "", "The router sends the prompt to a prefill worker. " * 30):
        assert router.encode_prompt(prompt) == w.engine.intake.tokenize(GenerateRequest("r", prompt=prompt))
    assert router.encode_chat(CHAT) == w.engine.intake.tokenize(GenerateRequest("r", messages=CHAT))


async def test_tokenizer_files_with_a_wrong_digest_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        TokenizerFiles.from_dict({"sha256": tokenizer_digest({"tokenizer.json": "{}"}),
                                  "files": {"tokenizer.json": "{} "}})
    with pytest.raises(ValueError, match="file name -> text"):
        TokenizerFiles.from_dict({"sha256": "", "files": {"tokenizer.json": 3}})


async def test_before_the_model_is_loaded_it_is_503_and_info_has_no_digest(start_worker):
    w = await start_worker(role="decode", attach=False)
    resp = await w.client.get("/internal/tokenizer")
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "not_ready"
    assert (await (await w.client.get("/internal/info")).json())["tokenizer_sha256"] == ""


async def test_the_tokenizer_needs_the_internal_secret(start_worker):
    w = await start_worker(role="prefill", kv_backend="memory", secret=SECRET)
    resp = await w.client.get("/internal/tokenizer")
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_internal_secret"
