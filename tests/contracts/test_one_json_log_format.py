"""`--log-format json` (router and workers alike): one JSON object per line, carrying the request id and other fields."""

from __future__ import annotations

import json
import logging

from tandem.contracts.logs import JsonFormatter, TextFormatter


def _record(**extra) -> logging.LogRecord:
    rec = logging.LogRecord("tandem.router", logging.INFO, __file__, 1, "request %s", ("done",), None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_json_lines_carry_extra_fields():
    line = JsonFormatter().format(_record(request_id="abc", status="200"))
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["message"] == "request done" and doc["level"] == "info"
    assert doc["request_id"] == "abc" and doc["status"] == "200"
    assert doc["time"].endswith("Z")


def test_text_lines_append_extra_fields():
    assert TextFormatter().format(_record(request_id="abc")).endswith("request done request_id=abc")
