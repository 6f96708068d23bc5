"""The chaos soak's verdict on each request: only an exact answer counts as served, an error the
client saw counts as retryable, and everything a client cannot detect is a silent failure."""

from bench.lib.chaos_outcomes import Outcome, classify, tally
from bench.lib.loadgen import NO_TOKEN
from bench.lib.metrics import RequestRecord

ANSWER = "the quick brown fox"


def rec(text: str = ANSWER, *, done: bool = True, error: str | None = None, timed_out: bool = False,
        index: int = 0) -> RequestRecord:
    chunks = [float(i) for i in range(len(text.split()))]
    return RequestRecord(index, 10, 4, send_s=0.0, chunk_times_s=chunks, end_s=5.0, text=text, error=error,
                         done=done, timed_out=timed_out, finish_reason="length" if done else None)


def test_the_exact_answer_with_done_is_identical():
    assert classify(rec(), ANSWER) is Outcome.IDENTICAL


def test_a_valid_request_refused_with_a_4xx_is_a_failure_not_a_retry():
    assert classify(rec("", done=False, error="HTTP 404: model_not_found"), ANSWER) is Outcome.REFUSED
    assert classify(rec("", done=False, error="HTTP 400: bad"), ANSWER) is Outcome.REFUSED
    assert classify(rec("", done=False, error="HTTP 429: busy"), ANSWER) is Outcome.CLEAN_ERROR


def test_errors_the_client_saw_are_clean_even_after_some_text():
    assert classify(rec("", done=False, error="HTTP 503: busy"), ANSWER) is Outcome.CLEAN_ERROR
    assert classify(rec("the quick", done=False, error='stream error: {"message": "worker died"}'),
                    ANSWER) is Outcome.CLEAN_ERROR
    assert classify(rec("the", done=False, error="ClientPayloadError: Response payload is not completed"),
                    ANSWER) is Outcome.CLEAN_ERROR


def test_a_short_answer_that_ended_without_an_error_is_truncated():
    assert classify(rec("the quick"), ANSWER) is Outcome.TRUNCATED
    assert classify(rec("", error=NO_TOKEN), ANSWER) is Outcome.TRUNCATED
    # the body closed cleanly without [DONE]: a client cannot tell it from a finished stream
    assert classify(rec(ANSWER, done=False), ANSWER) is Outcome.TRUNCATED


def test_another_answer_is_wrong_text_and_silence_is_a_hang():
    assert classify(rec("the quick brown cat"), ANSWER) is Outcome.WRONG_TEXT
    assert classify(rec(ANSWER + " jumps"), ANSWER) is Outcome.WRONG_TEXT
    assert classify(rec("the", done=False, error="ServerTimeoutError: read", timed_out=True),
                    ANSWER) is Outcome.HUNG


def test_tally_counts_every_outcome_and_lists_the_silent_ones():
    records = [rec(), rec(index=1, text="b", done=False, error="HTTP 503: x"),
               rec(index=1, text="b", done=False, error="HTTP 503: y"), rec("the quick")]
    t = tally(records, {0: ANSWER, 1: "b c"})
    assert t["outcomes"] == {"identical": 1, "clean_error": 2, "refused": 0, "truncated": 1, "wrong_text": 0,
                             "hung": 0}
    assert t["errors_by_kind"] == {"HTTP 503": 2}
    assert [(s["index"], s["outcome"]) for s in t["failures"]] == [(0, "truncated")]


def test_the_report_shows_every_count_kill_and_leftover():
    from bench.lib.chaos_report import results_markdown

    r = {"ok": False, "requests": 5, "outcomes": {"identical": 3, "clean_error": 1, "refused": 0, "truncated": 1,
                                                  "wrong_text": 0, "hung": 0},
         "errors_by_kind": {"HTTP 503": 1},
         "settings": {"duration_s": 600, "interval_s": [20, 40], "streams": 6, "kv_backend": "nixl",
                      "worker_arg": ["--compile=off"], "read_timeout_s": 60},
         "events": [{"process": "decode-1", "signal": "SIGKILL", "back_after_s": 30.0},
                    {"process": "router-0", "signal": "SIGTERM", "restart_error": "not ready"}],
         "left": {"settled_after_s": 31.0, "final": {"decode-1": {"blocks_held": 4, "leased": 1, "running": 0,
                                                                  "waiting": 0}, "router-0": {"in_flight": 0.0}},
                  "at_load_end": {}},
         "resources": {"decode-1": {"restarts": 1, "start": {"fds": 20, "rss_mib": 1000.0},
                                    "end": {"fds": 90, "rss_mib": 1500.0}}}}
    md = results_markdown(r, "20260101-000000", "python -m bench chaos")
    assert "**failures found**" in md and "| truncated without an error | 1 |" in md and "HTTP 503 1" in md
    assert "decode SIGKILL 1, router SIGTERM 1" in md and "1 restarts failed" in md
    assert "| decode-1 | 4 | 1 |" in md and "20 → 90" in md


def test_the_report_shows_growth_within_a_spared_process():
    from bench.lib.chaos_report import results_markdown

    r = {"ok": True, "requests": 1, "outcomes": {"identical": 1, "clean_error": 0, "refused": 0, "truncated": 0,
                                                 "wrong_text": 0, "hung": 0},
         "errors_by_kind": {},
         "settings": {"duration_s": 600, "interval_s": [20, 40], "streams": 6, "kv_backend": "nixl",
                      "worker_arg": ["--compile=off"], "read_timeout_s": 60, "spare": ["decode-0"], "watch_s": 30},
         "events": [{"process": "prefill-1", "signal": "SIGKILL", "back_after_s": 30.0}],
         "left": {"settled_after_s": 0.0, "final": {}, "at_load_end": {}},
         "resources": {}, "loadavg": {"samples": 5, "min": 2.0, "median": 8.0, "max": 12.5},
         "spared_series": [{"t_s": 0.0, "decode-0": {"fds": 30, "rss_mib": 1400.0, "kv_peers": 2}},
                           {"t_s": 30.0, "decode-0": {"fds": 37, "rss_mib": 1500.0, "kv_peers": 3}},
                           {"t_s": 60.0, "decode-0": {"fds": 31, "rss_mib": 1450.0, "kv_peers": 2}}]}
    md = results_markdown(r, "20260101-000000", "python -m bench chaos --spare decode-0")
    assert "a kill every 20-40 s, never killed: decode-0" in md and "load average 2.0-12.5 (median 8.0)" in md
    assert ("**decode-0**, never killed, sampled 3 times every 30 s: open fds 30 at the first sample, 30-37 "
            "throughout, 31 at the last; RSS 1400 → 1450 MiB (max 1500); KV peers known 2 → 2 (max 3)") in md


def test_a_tensor_parallel_soak_names_follower_kills_and_has_its_own_section(tmp_path):
    from bench.lib.chaos_report import publish, results_markdown

    r = {"ok": True, "requests": 2, "outcomes": {"identical": 2, "clean_error": 0, "refused": 0, "truncated": 0,
                                                 "wrong_text": 0, "hung": 0},
         "errors_by_kind": {},
         "settings": {"duration_s": 600, "interval_s": [20, 40], "streams": 6, "kv_backend": "nixl", "tp": 2,
                      "worker_arg": ["--compile=off", "--tensor-parallel", "2"], "read_timeout_s": 60},
         "events": [{"process": "decode-1", "rank": "rank-1", "signal": "SIGKILL", "back_after_s": 30.0},
                    {"process": "decode-0", "rank": "", "signal": "SIGKILL", "back_after_s": 20.0}],
         "left": {"settled_after_s": 0.0, "final": {}, "at_load_end": {}}, "resources": {}}
    assert "decode SIGKILL 1, decode rank-1 SIGKILL 1" in results_markdown(r, "20260101-000000", "c")
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## Chaos soak (issue 21)\n\n<!-- bench:chaos:begin (written by `python -m "
                   "bench chaos`; edit outside these markers) -->\nplain soak\n<!-- bench:chaos:end -->\n")
    publish(r, "20260101-000000", "c", doc)
    text = doc.read_text()
    assert "plain soak" in text and "### Chaos soak with tensor-parallel groups (issue 28)" in text
    assert text.index("bench:chaos-tp:begin") > text.index("bench:chaos:end")
