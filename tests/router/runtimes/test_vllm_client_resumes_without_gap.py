"""A resumed request on vLLM (issue 29 item 3): when a decode server dies the router asks another with
`generated_token_ids` (every token the client has) and `emitted_chars` (its text); the vllm runtime's
client continues from there, with no token or character repeated or skipped: the client's text plus
the resumed stream is exactly what one uninterrupted vLLM server streams. With a grammar the grammar's
state matters, so vLLM regenerates the tokens the client has (each checked) instead of reading them
as prompt, and the output still follows the grammar."""

from __future__ import annotations

import json

import pytest
from tandem.contracts.protocol import EventType, GenerateRequest
from tandem.contracts.sampling import SamplingParams
from tandem.router.tokenizer import RouterTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPT = "Numbers like 0 1 2 3 and words like café and 東京 go through the resumed stream: "


async def stream(client, url: str, req: GenerateRequest) -> list[tuple[list[int], str]]:
    """The TOKEN lines of a stream that finished: (token ids, text) each."""
    events = [ev async for ev in client.generate(url, req)]
    assert events[0].type is EventType.START and events[-1].type is EventType.FINISH
    return [(ev.token_ids, ev.text) for ev in events if ev.type is EventType.TOKEN]


def upto(lines: list[tuple[list[int], str]], k: int) -> tuple[list[int], str]:
    """What a client had after the token lines that bring it closest to k tokens without passing k
    (the first line at least): those tokens and their text. A client only ever has whole lines: a
    loaded server streams several tokens in one chunk, and the text of such a line (a character
    whose bytes span its tokens) cannot be split between them."""
    tokens: list[int] = []
    text = ""
    for ids, t in lines:
        if tokens and len(tokens) + len(ids) > k:
            break
        tokens += ids
        text += t
    return tokens, text


async def test_a_resume_continues_exactly_where_the_client_is(vllm_servers, vllm_client, vllm_toy_model_dir):
    ids = RouterTokenizer.from_dir(vllm_toy_model_dir).encode_prompt(PROMPT)
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    whole = await stream(vllm_client, vllm_servers.colocated.url, GenerateRequest("whole", prompt_token_ids=ids,
                                                                                 sampling=sampling))
    all_tokens, all_text = upto(whole, 40)
    assert len(all_tokens) == 40
    for k in (1, 9, 39):
        had, text = upto(whole, k)
        req = GenerateRequest(f"resume-{k}", prompt_token_ids=ids, sampling=sampling, generated_token_ids=had,
                              emitted_chars=len(text))
        rest = await stream(vllm_client, vllm_servers.decode.url, req)
        assert had + [t for ids_, _ in rest for t in ids_] == all_tokens, f"resumed after {k} tokens"
        assert text + "".join(t for _, t in rest) == all_text, f"resumed after {k} tokens"


async def test_a_resume_under_a_grammar_regenerates_what_the_client_has(vllm_servers, vllm_client, vllm_toy_model_dir):
    ids = RouterTokenizer.from_dir(vllm_toy_model_dir).encode_prompt("Answer in JSON: ")
    sampling = SamplingParams(max_tokens=30, temperature=0.0, structured={"json_object": True})
    whole = await stream(vllm_client, vllm_servers.colocated.url, GenerateRequest("json-whole", prompt_token_ids=ids,
                                                                                 sampling=sampling))
    all_tokens, all_text = upto(whole, 30)
    had, text = upto(whole, 5)
    req = GenerateRequest("json-resume", prompt_token_ids=ids, sampling=sampling, generated_token_ids=had,
                          emitted_chars=len(text))
    rest = await stream(vllm_client, vllm_servers.decode.url, req)
    assert had + [t for ids_, _ in rest for t in ids_] == all_tokens
    assert text + "".join(t for _, t in rest) == all_text
    if len(all_tokens) < 30:  # the grammar closed the object before max_tokens
        assert isinstance(json.loads(all_text), dict)
