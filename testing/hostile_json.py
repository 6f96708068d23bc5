"""Hypothesis strategies for hostile request bodies, and a raw HTTP client to send them with.

Shared by the fuzzers of the router's public API and of the workers' internal API: any JSON value
(lone surrogates, huge integers, NaN/Infinity literals, nesting), valid requests with some fields
replaced by such values, raw byte bodies (invalid UTF-8, deep brackets, long number literals) and
odd Content-Type headers. Test harness only.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from tandem.contracts.internal_auth import auth_headers

# Bounded and derandomized (a failure reproduces); TANDEM_FUZZ_EXAMPLES raises the count to search further.
FUZZ = settings(
    max_examples=int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "150")), deadline=None, derandomize=True,
    database=None, suppress_health_check=list(HealthCheck),
)

# Text that includes lone surrogates (category Cs): json.dumps writes them as \\udXXX escapes.
texts = st.text(st.characters(codec=None, categories=["L", "N", "P", "Z", "S", "Cs", "Cc"]), max_size=24)
integers = st.one_of(st.integers(-5, 600), st.integers(-(2**80), 2**80))
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e-300, 5e-324, -0.0, 1e308])
scalars = st.none() | st.booleans() | integers | floats | texts
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=12
)

CONTENT_TYPES = st.sampled_from([
    None, "application/json", "application/json; charset=utf-8", "application/json; charset=UTF8",
    "application/json; charset=utf-16", "application/json; charset=nope", "application/json; charset=",
    "text/plain", "application/x-www-form-urlencoded", "application/octet-stream", "multipart/form-data",
    "application/vnd.api+json", "application/json;;;", ";", "", "application/json; charset=\"latin-1\"",
])


def dumps(value: Any) -> bytes:
    """JSON as a careless client writes it: NaN and Infinity as bare literals, surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    """Bodies that are not JSON a careful client would send."""
    n = draw(st.integers(1, 300_000))
    return draw(st.sampled_from([
        b"[" * n, b"{\"a\":" * min(n, 50_000), b"1" * min(n, 10_000), b"-" + b"9" * min(n, 5_000),
        b"{\"seed\": " + b"7" * min(n, 6_000) + b"}", b"NaN", b"[Infinity, -Infinity]", b"1e999",
        b"\xff\xfe{}", b"\xef\xbb\xbf{}", b"{\"prompt\": \"a\xed\xa0\x80b\"}", b"", b"null", b"\"str\"",
        b"{\"a\": 1,}", b"{\"a\"}", "{\"prompt\": \"é\"}".encode("utf-16"), b"\x00" * min(n, 64),
    ]) | st.binary(max_size=64))


def mutate(draw: st.DrawFn, base: dict[str, Any], fields: dict[str, st.SearchStrategy]) -> dict[str, Any]:
    """`base` with up to three fields replaced, removed or added: a named field takes a value from
    its own strategy in `fields` (else any JSON value)."""
    body = dict(base)
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(fields)) | texts)
        if draw(st.integers(0, 9)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(fields.get(key, json_values))
    return body


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


def post(url: str, path: str, body: bytes, content_type: str | None = "application/json",
         headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> Answer:
    """One POST with exactly these bytes and this Content-Type (None: no header at all)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.putrequest("POST", path, skip_accept_encoding=True)
        if content_type is not None:
            conn.putheader("Content-Type", content_type)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        return Answer(resp.status, resp.getheader("Content-Type", ""), data,
                      {k.lower(): v for k, v in resp.getheaders()})
    finally:
        conn.close()


def assert_openai_error(answer: Answer) -> dict[str, Any]:
    """A 4xx whose body is OpenAI's error object; returns the error."""
    assert 400 <= answer.status < 500, (answer.status, answer.body[:300])
    assert answer.content_type.startswith("application/json"), (answer.content_type, answer.body[:300])
    err = answer.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    return err


def wait_pools_idle(worker_urls: list[str], timeout_s: float = 40.0, secret: str | None = None) -> None:
    """Until every worker is idle: nothing running, waiting or leased, every KV block free (aborts and
    releases land asynchronously); AssertionError naming the busy ones after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = {}
        for url in worker_urls:
            req = urllib.request.Request(url + "/internal/info", headers=auth_headers(secret))
            with urllib.request.urlopen(req, timeout=5) as r:
                infos[url] = json.load(r)
        busy = {u: i for u, i in infos.items() if i["running"] or i["waiting"] or i["leased"]
                or i["kv_blocks_free"] != i["kv_blocks_total"]}
        if not busy:
            return
        assert time.monotonic() < deadline, f"KV blocks not all back: {busy}"
        time.sleep(0.1)
