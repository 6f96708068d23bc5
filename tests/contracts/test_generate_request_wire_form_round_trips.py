"""GenerateRequest's wire form (what the router sends a worker): every field survives JSON and
from_dict, nested ones included (a tensor-parallel KV source's ranks, chat messages), and the form
holds exactly what dataclasses.asdict gave before to_dict stopped deep-copying the prompt's ids."""

from __future__ import annotations

import dataclasses
import json

from tandem.contracts.kv_source import KVRank, KVSource
from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import SamplingParams


def _full() -> GenerateRequest:
    kv = KVSource("http://p:8000", "p-1", "tcp", [3, 4, 5], 11, lease_token="t" * 32, extra={"port": 9},
                  ranks=[KVRank("http://p1:8000", "p-1-r1", {"port": 10})], kv_compat="abc")
    return GenerateRequest("r-1", messages=[{"role": "user", "content": "hi", "name": None}],
                           prompt_token_ids=list(range(400)), sampling=SamplingParams(max_tokens=7, temperature=0.5),
                           chat_options={"chat_template_kwargs": {"x": [1, 2]}}, kv_source=kv,
                           generated_token_ids=[42], emitted_chars=3, migrated_from="http://d:1", cache_salt="s",
                           fairness_id="tenant-a", priority=3)


def test_every_field_survives_json_and_from_dict():
    req = _full()
    back = GenerateRequest.from_dict(json.loads(json.dumps(req.to_dict())))
    assert back == req
    assert isinstance(back.kv_source.ranks[0], KVRank)


def test_the_wire_form_is_what_asdict_gave():
    for req in (_full(), GenerateRequest("r-2", prompt="hello")):
        want = dataclasses.asdict(req) | {"sampling": req.sampling.to_wire()}
        assert json.dumps(req.to_dict(), sort_keys=True) == json.dumps(want, sort_keys=True)
