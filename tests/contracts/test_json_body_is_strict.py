"""The strict JSON reader shared by the router and the workers: what Python's json lets through
(or crashes on) is a BodyError with a 4xx status, and ordinary bodies parse unchanged."""

from __future__ import annotations

import pytest
from tandem.contracts.json_body import MAX_DEPTH, BodyError, check_content_type, decode_json


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"[" * 200_000, "invalid_json", None),
        (b"{\"x\": " + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", "invalid_json", "x"),
        (b"{\"seed\": " + b"1" * 5000 + b"}", "invalid_value", None),
        (b"{\"seed\": 18446744073709551616}", "invalid_value", "seed"),
        (b"{\"ids\": [1, 2, -9223372036854775809]}", "invalid_value", "ids"),
        (b"{\"t\": NaN}", "invalid_value", None),
        (b"{\"t\": [1.5, -Infinity]}", "invalid_value", None),
        (b"{\"t\": 1e400}", "invalid_value", "t"),
        (b"{\"p\": \"a\\ud800b\"}", "invalid_value", "p"),
        (b"{\"a\\udfff\": 1}", "invalid_value", None),
        (b"{\"p\": \"a\xed\xa0\x80b\"}", "invalid_json", None),
        (b"\xff{}", "invalid_json", None),
        (b"", "invalid_json", None),
        (b"{\"a\": 1,}", "invalid_json", None),
    ],
)
def test_refused_bodies_are_400_naming_the_field(raw, code, param):
    with pytest.raises(BodyError) as info:
        decode_json(raw, "application/json")
    assert (info.value.status, info.value.code, info.value.param) == (400, code, param)


@pytest.mark.parametrize("header", ["text/plain", "application/x-www-form-urlencoded", "application/json; charset=utf-16",
                                    "application/json; charset=bogus", "application/json; charset=\"latin-1\""])
def test_non_json_content_types_and_charsets_are_415(header):
    with pytest.raises(BodyError) as info:
        check_content_type(header)
    assert (info.value.status, info.value.code) == (415, "unsupported_media_type")


@pytest.mark.parametrize("header", [None, "", "application/json", "Application/JSON; charset=UTF-8",
                                    "application/json; charset=\"utf8\"", "application/vnd.api+json"])
def test_json_content_types_pass(header):
    body = {"model": "m", "ids": list(range(1000)), "t": 1e-300, "big": 2**64 - 1, "s": "é\u2028", "n": None}
    assert decode_json(b'{"model": "m", "ids": [' + ",".join(map(str, range(1000))).encode()
                       + b'], "t": 1e-300, "big": 18446744073709551615, "s": "\\u00e9\\u2028", "n": null}',
                       header) == body
