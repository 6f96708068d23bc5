"""Flow control in a real router process (issue 31 item 4): with one place at the gate, a tenant that
sends four requests at once waits behind its own, so another tenant's request arriving after them is
served third, not fifth (FIFO would serve it last); a request that finds its band full gets a 429
with Retry-After in OpenAI's format, counted in the router's metrics. The decode worker is a paced
stand-in (tandem.testing.paced_worker): each answer takes two seconds, whatever the machine."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tandem.router.flow_control import FAIRNESS_HEADER
from tandem.testing.cluster import wait_until
from tandem.testing.hostile_json import assert_openai_error, dumps, post
from tandem.testing.paced_worker import start_paced_worker
from tandem.testing.router_process import RouterProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BODY = dumps({"model": "paced", "prompt": "hi", "max_tokens": 8})


def wait_metric(r: RouterProcess, series: str, value: float) -> None:
    wait_until(lambda: r.metric(series) == value, timeout=20, what=f"{series} at {value}")


def test_a_flooding_tenant_waits_behind_its_own_requests_and_a_full_band_is_a_429():
    worker = start_paced_worker("--tokens", "8", "--interval-s", "0.25")
    r = RouterProcess("--decode", worker.url, "--max-concurrent-requests", "1", "--flow-band-capacity", "4",
                      "--flow-ttl-s", "30").start()
    done: dict[str, float] = {}

    def send(name: str, tenant: str):
        answer = post(r.url, "/v1/completions", BODY, headers={FAIRNESS_HEADER: tenant})
        done[name] = time.monotonic()
        return answer

    try:
        with ThreadPoolExecutor(8) as pool:
            flood = [pool.submit(send, f"a{i}", "flood") for i in range(1)]
            wait_metric(r, "tandem_requests_in_flight", 1)
            flood += [pool.submit(send, f"a{i}", "flood") for i in range(1, 4)]
            wait_metric(r, "tandem_router_flow_waiting", 3)
            quiet = pool.submit(send, "b0", "quiet")
            wait_metric(r, "tandem_router_flow_waiting", 4)
            refused = post(r.url, "/v1/completions", BODY, headers={FAIRNESS_HEADER: "late"})
            answers = [f.result() for f in (*flood, quiet)]
        assert refused.status == 429 and int(refused.headers["retry-after"]) >= 1, refused
        assert assert_openai_error(refused)["code"] == "rate_limit_exceeded"
        assert all(a.status == 200 and a.json()["choices"][0]["text"] == "".join(f" t{i}" for i in range(8)) for a in answers)
        order = sorted(done, key=done.get)  # (a1..a3 arrive together, in any order among themselves)
        assert order[0] == "a0" and order[2] == "b0" and set(order) == {"a0", "a1", "a2", "a3", "b0"}, order
        assert r.metric('tandem_router_flow_refused_total{reason="band_full"}') == 1
        assert r.metric("tandem_router_flow_waiting") == 0
    finally:
        r.kill()
        worker.kill()
