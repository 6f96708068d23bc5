"""The handoff parity probe with real worker processes and a real router, KV over TCP.

Three workers: a prefill worker and a decode worker of the toy model, and a decode worker of another
toy model (same shapes and tokenizer, another seed): a pairing broken on purpose, as wrong weights
on one node would break it. A good pairing is proven with no difference at all (float32); the broken
one is caught, its worker gets no KV, and the answers are what a single worker computes; without
the probe the same pairing serves mixed-up text.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tandem.contracts.handoff_parity import ParityReport, ParityState, ProbeOutcome
from tandem.testing.cluster import free_port
from tandem.testing.router_process import RouterProcess
from tandem.testing.scraped import scrape, value
from tandem.testing.worker_process import WorkerProcess
from tandem.worker.local.processes import ManagedProcess, Supervisor

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "The prefill worker hands its KV cache to the decode worker, which goes on from there. " * 2


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy model's shapes and tokenizer with other weights (seed 1)."""
    from tandem.worker.local.toy_model import make_toy_model

    return make_toy_model(tmp_path_factory.mktemp("other") / "toy-llama-seed1", seed=1)


@pytest.fixture(scope="module")
def workers(toy_model_dir: Path, other_model_dir: Path):
    """prefill (seed 0), decode (seed 0), decode with other weights (seed 1); KV over TCP."""
    sup = Supervisor()
    try:
        specs = {"prefill": (toy_model_dir, "prefill"), "decode": (toy_model_dir, "decode"),
                 "other": (other_model_dir, "decode")}
        procs = {name: sup.add(WorkerProcess(model, role, "--kv-backend", "tcp", "--served-name", "toy",
                                             "--kv-compat", "g1"))
                 for name, (model, role) in specs.items()}
        for p in procs.values():
            ManagedProcess.start(p)  # all three load at once
        sup.wait_ready(procs.values())
        yield {name: p.url for name, p in procs.items()}
    finally:
        sup.stop()


@contextlib.contextmanager
def router(*args: str) -> Iterator[RouterProcess]:
    """A router over the given workers, stopped for sure; it serves once its pairings are probed."""
    r = RouterProcess("--policy", "least-loaded", "--tokenizer", "off", *args)
    try:
        yield r.start()
    finally:
        r.stop()


def parity(url: str) -> ParityReport:
    with urllib.request.urlopen(url + "/internal/parity", timeout=10) as r:
        return ParityReport.from_dict(json.load(r))


def complete(url: str, max_tokens: int = 12) -> str:
    body = {"model": "toy", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["text"]


def by_url(report: ParityReport) -> dict[str, tuple[ParityState, float | None]]:
    return {w.url: (w.state, w.last.max_abs_diff if w.last else None) for w in report.workers}


def test_a_good_pairing_is_proven_exactly_and_handed_off(workers):
    with router("--prefill", workers["prefill"], "--decode", workers["decode"]) as r:
        report = parity(r.url)  # the router proved the pairing before it started serving
        assert report.enabled
        assert by_url(report) == {workers["prefill"]: (ParityState.VERIFIED, 0.0),
                                  workers["decode"]: (ParityState.VERIFIED, 0.0)}, report
        last = report.workers[0].last
        assert last.outcome is ProbeOutcome.MATCH and last.dtype == "float32" and last.tokens == 8
        complete(r.url)
        m = scrape(r.url + "/metrics")
        assert value(m, "tandem_router_routes_total", route="disaggregated") == 1
        assert value(m, "tandem_router_parity_probes_total", outcome="match") == 1
        assert value(m, "tandem_router_parity_workers", state="verified") == 2
        # the same report passes on each worker's KV health from its /internal/info (for the operator's
        # KVTransferReady, which then asks the routers, not every worker)
        report = parity(r.url)
        assert sorted(report.kv_health) == sorted([workers["prefill"], workers["decode"]]), report.kv_health
        assert {(h.backend, h.healthy) for h in report.kv_health.values()} == {("tcp", True)}
        assert report.unreachable == {}


def test_the_report_says_which_worker_the_router_cannot_reach(workers):
    gone = f"http://127.0.0.1:{free_port()}"
    with router("--prefill", workers["prefill"], "--decode", workers["decode"], "--decode", gone) as r:
        report = parity(r.url)
        assert sorted(report.kv_health) == sorted([workers["prefill"], workers["decode"]])
        assert list(report.unreachable) == [gone] and gone in report.unreachable[gone], report.unreachable


def test_a_decode_worker_with_other_weights_is_caught_and_gets_no_kv(workers):
    alone = direct_answer(workers["other"])
    with router("--prefill", workers["prefill"], "--decode", workers["other"]) as r:
        report = parity(r.url)
        states = by_url(report)
        assert {s for s, _ in states.values()} == {ParityState.MISMATCH}, report
        diff = states[workers["other"]][1]
        assert diff is not None and diff > 0.1, "other weights differ by far more than any tolerance"
        assert "tolerance 0.0001" in report.workers[0].last.message
        assert "confirmed by a second probe" in report.workers[0].last.message
        pulled_before = kv_pulled(workers["other"])
        texts = {complete(r.url) for _ in range(3)}
        assert texts == {alone}, "decode-side prefill: the decode worker's own answer, nothing mixed"
        assert kv_pulled(workers["other"]) == pulled_before, "no KV reached the worker the probe caught"
        m = scrape(r.url + "/metrics")
        assert value(m, "tandem_router_routes_total", route="parity_mismatch") == 3
        assert value(m, "tandem_router_routes_total", route="disaggregated") == 0
        assert value(m, "tandem_router_parity_probes_total", outcome="mismatch") == 2  # and its confirmation
        assert value(m, "tandem_router_parity_last_max_abs_logprob_diff") == pytest.approx(diff)


def test_without_the_probe_the_same_pairing_serves_mixed_text(workers):
    """The control: the broken pairing really is broken (what the probe keeps clients from)."""
    alone = direct_answer(workers["other"])
    with router("--prefill", workers["prefill"], "--decode", workers["other"], "--no-parity-probe") as r:
        report = parity(r.url)
        assert (report.enabled, report.workers, sorted(report.kv_health)) == (
            False, [], sorted([workers["prefill"], workers["other"]])), "no verdicts; the KV health still passed on"
        assert complete(r.url) != alone
        assert value(scrape(r.url + "/metrics"), "tandem_router_routes_total", route="disaggregated") == 1


def test_the_odd_worker_out_is_isolated_and_the_rest_keep_handing_off(workers):
    urls = ["--prefill", workers["prefill"], "--decode", workers["decode"], "--decode", workers["other"]]
    with router(*urls) as r:
        states = by_url(parity(r.url))
        assert states[workers["other"]][0] is ParityState.MISMATCH
        assert states[workers["prefill"]] == states[workers["decode"]] == (ParityState.VERIFIED, 0.0)
        pulled_before = kv_pulled(workers["other"])
        for _ in range(4):
            complete(r.url, max_tokens=4)
        m = scrape(r.url + "/metrics")
        assert value(m, "tandem_router_routes_total", route="disaggregated") == 4
        assert kv_pulled(workers["other"]) == pulled_before


def direct_answer(url: str) -> str:
    """The worker's own greedy answer to PROMPT, asked directly (no router, no handoff)."""
    with router("--decode", url, "--no-parity-probe") as r:
        return complete(r.url)


def kv_pulled(worker_url: str) -> float:
    return value(scrape(worker_url + "/metrics"), "tandem_kv_transfer_bytes_total", direction="pull")
