"""The multi-turn chat workload is the same for every arm and resends the whole conversation; a
run's summary splits first and later turns and counts hits and KV bytes as the report says."""

import math

import pytest

from bench.lib.chat_workload import ChatSpec, messages_for, plan_chat
from bench.lib.metrics import RequestRecord
from bench.lib.multiturn_report import headline, summarize_run


def count(text: str) -> int:
    return len(text.split()) + 1  # a BOS, like the real tokenizer


SPEC = ChatSpec("t", conversations=3, turns=3, system_tokens=40, user_tokens=(5, 9), output_len=4,
                rate=2.0, think_s=0.5, seed=3)


def test_plan_is_deterministic_and_shares_the_system_prompt():
    a, b = plan_chat(SPEC, count), plan_chat(SPEC, count)
    assert a == b
    assert count(a.system) == 40
    assert [c.start_s for c in a.conversations] == sorted(c.start_s for c in a.conversations)
    for c in a.conversations:
        assert len(c.user_messages) == 3 and c.think_s[0] == 0 and all(t > 0 for t in c.think_s[1:])
        assert all(5 <= count(u) <= 9 for u in c.user_messages)
    assert plan_chat(ChatSpec(**{**SPEC.__dict__, "seed": 4}), count).system != a.system
    assert len({a.request_index(c, t) for c in range(3) for t in range(3)}) == 9


def test_every_turn_resends_the_conversation():
    plan = plan_chat(SPEC, count)
    conv = plan.conversations[1]
    assert messages_for(plan, conv, []) == [{"role": "system", "content": plan.system},
                                            {"role": "user", "content": conv.user_messages[0]}]
    third = messages_for(plan, conv, ["A0", "A1"])
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in third[1:]] == [conv.user_messages[0], "A0", conv.user_messages[1], "A1",
                                                 conv.user_messages[2]]


def test_bad_specs_are_refused():
    with pytest.raises(ValueError):
        ChatSpec("x", 0, 1, 10, (1, 2), 4, rate=1.0, think_s=0.0)
    with pytest.raises(ValueError):
        ChatSpec("x", 1, 1, 10, (3, 2), 4, rate=1.0, think_s=0.0)


def rec(i: int, send: float, first: float, prompt: int) -> RequestRecord:
    return RequestRecord(i, 0, 4, send_s=send, chunk_times_s=[first, first + 0.1, first + 0.3], end_s=first + 0.4,
                         prompt_tokens=prompt, completion_tokens=3, text="x")


def run(arm: str, role_counters: dict, rep: int = 0) -> dict:
    return {"arm": arm, "rep": rep, "kv_bytes_per_token": 100,
            "records": [rec(0, 0.0, 1.0, 300), rec(1, 2.0, 2.2, 400), rec(2, 5.0, 5.3, 500)],
            "turns": {0: 0, 1: 1, 2: 2}, "workers": role_counters, "routes": {"cached_prefix": 1.0}}


def counters(role: str, hit: float = 0.0, pulled: float = 0.0, saved: float = 0.0) -> dict:
    return {"role": role, "tandem_worker_prefix_cache_hit_tokens_total": hit,
            "tandem_kv_transfer_bytes_total": pulled, "tandem_worker_kv_pull_saved_bytes_total": saved}


def test_summary_splits_turns_and_counts_hits_and_bytes():
    sm = summarize_run(run("d", {"p": counters("prefill", hit=200),
                                 "d": counters("decode", hit=400, pulled=30_000, saved=10_000)}))
    assert sm["ttft_first"]["n"] == 1 and sm["ttft_first"]["p50"] == pytest.approx(1.0)
    assert sm["ttft_later"]["n"] == 2 and sm["ttft_later"]["p50"] == pytest.approx(0.25)
    assert sm["itl"]["n"] == 6
    # decode's 400 hit tokens: 100 of them saved a pull (10,000 B at 100 B/token), 300 a computation.
    assert sm["hit_rate"] == pytest.approx((200 + 300) / 1200)
    assert sm["kv_bytes_per_request"] == pytest.approx(10_000)
    assert sm["kv_saved_bytes_per_request"] == pytest.approx(10_000 / 3)
    assert sm["handoff_held_share"] == pytest.approx(0.25)
    assert sm["cached_prefix_routes"] == 1.0
    colo = summarize_run(run("c", {"c0": counters("colocated", hit=600), "c1": counters("colocated")}))
    assert colo["hit_rate"] == pytest.approx(0.5) and math.isnan(colo["kv_bytes_per_request"])


def test_headline_is_prefix_aware_over_cache_off():
    runs = []
    for arm, first in (("colocated-cache-off", 1.0), ("colocated-prefix-aware", 0.5)):
        r = run(arm, {"c0": counters("colocated")})
        r["records"][1].chunk_times_s = [x - 2.2 + 2.0 + first for x in r["records"][1].chunk_times_s]
        r["records"][2].chunk_times_s = [x - 5.3 + 5.0 + first for x in r["records"][2].chunk_times_s]
        r["summary"] = summarize_run(r)
        runs.append(r)
    h = headline({"runs": runs, "arms": ["colocated-cache-off", "colocated-prefix-aware"]})
    assert h["colocated_later_ttft_ratio"] == pytest.approx(0.5)
