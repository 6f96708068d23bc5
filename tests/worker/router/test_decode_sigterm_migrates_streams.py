"""SIGTERM to a decode worker under load, as Kubernetes sends a pod it removes: real worker and router
processes on loopback (toy model, fp32, greedy, ignore_eos). Streams running on that worker move to
the other decode worker by KV transfer (decode to decode, over the tcp or NIXL handoff); every
stream completes without an error with exactly the text of an undisturbed run; the router counts
the migrations by outcome and the destination pulled the KV instead of recomputing it. When the
KV cannot be pulled (the leaving worker's lease is gone before the pull), the stream still
completes, identically, by recompute.
"""

from __future__ import annotations

import signal
import threading

import openai
import pytest
from tandem.testing.router_process import RouterProcess
from tandem.testing.worker_process import WorkerProcess
from tandem.worker.local.processes import Supervisor

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STREAMS = 6
MAX_TOKENS = 160
TOKENS_BEFORE_SIGTERM = 12
PROMPTS = [f"Stream {i}: the operator scales the decode pool down while tokens keep flowing." for i in range(STREAMS)]


def _nixl_available() -> bool:
    try:
        from tandem.worker.kv import nixl  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(params=["tcp", pytest.param("nixl", marks=pytest.mark.nixl)])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "nixl" and not _nixl_available():
        pytest.skip("needs the nixl package (nixl-cu12, installed by `make venv`)")
    return request.param


@pytest.fixture
def group():
    sup = Supervisor()
    try:
        yield sup
    finally:
        sup.stop()


def _stack(group: Supervisor, toy_model_dir, backend: str, decode_args: tuple[str, ...] = ()):
    """A prefill worker, two decode workers (one will leave) and a router that alternates them."""
    kv = ("--kv-backend", backend)
    workers = [group.add(WorkerProcess(toy_model_dir, role, *kv, *args))
               for role, args in (("prefill", ()), ("decode", decode_args), ("decode", decode_args))]
    for w in workers:
        w.start()
    prefill, *decode = workers
    router = group.add(RouterProcess("--prefill", prefill.url, "--decode", decode[0].url, "--decode", decode[1].url,
                                     "--short-prompt-threshold", "0", "--policy", "round-robin"))
    router.start()
    return decode, router


def _metric(proc, series: str) -> float:
    for line in proc.get_text("/metrics").splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


class Streams:
    """STREAMS concurrent completions, each on its own thread; counts tokens as they arrive."""

    def __init__(self, url: str, model: str) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = model
        self.texts = [""] * STREAMS
        self.chunks = [0] * STREAMS
        self.errors: list[str] = []
        self.finish: list[str | None] = [None] * STREAMS
        self.changed = threading.Condition()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        try:
            stream = self.client.completions.create(model=self.model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                with self.changed:
                    for c in chunk.choices:
                        self.texts[i] += c.text or ""
                        self.finish[i] = c.finish_reason or self.finish[i]
                    self.chunks[i] += 1
                    self.changed.notify_all()
        except Exception as e:  # reported by the test
            with self.changed:
                self.errors.append(f"stream {i}: {e!r}")
                self.changed.notify_all()

    def wait(self, predicate, timeout_s: float, what: str) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: predicate() or self.errors, timeout_s):
                raise AssertionError(f"timed out waiting for {what}: chunks {self.chunks}")
        assert not self.errors, self.errors

    def join(self, timeout_s: float = 120.0) -> None:
        for t in self.threads:
            t.join(timeout_s)
            assert not t.is_alive(), "a stream did not end"


def _undisturbed(router, model: str) -> list[str]:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]


def _sigterm_mid_stream(decode: list, router, model: str) -> tuple[Streams, object, object]:
    """Start the streams; once each has tokens, SIGTERM the decode worker running more of them.
    The streams, the worker that left and the one that stayed."""
    streams = Streams(router.url, model)
    streams.wait(lambda: min(streams.chunks) >= TOKENS_BEFORE_SIGTERM, 120, "every stream's first tokens")
    running = [w.get_json("/internal/info")["running"] for w in decode]
    leaving, staying = decode if running[0] >= running[1] else decode[::-1]
    assert max(running) > 0, "no stream runs on a decode worker"
    leaving.signal(signal.SIGTERM)
    streams.join()
    assert not streams.errors, streams.errors
    assert all(f == "length" for f in streams.finish), streams.finish
    return streams, leaving, staying


def test_sigterm_moves_running_streams_by_kv_transfer(group, toy_model_dir, model_name, backend):
    decode, router = _stack(group, toy_model_dir, backend)
    expected = _undisturbed(router, model_name)
    computed_before = [_metric(w, "tandem_worker_prefill_tokens_computed_total") for w in decode]
    streams, leaving, staying = _sigterm_mid_stream(decode, router, model_name)
    assert streams.texts == expected, "a migrated stream differs from the undisturbed run"
    assert leaving.proc.wait(60) == 0, leaving.log()[-3000:]
    assert "draining: handing" in leaving.log()
    moved = _metric(router, 'tandem_router_migrations_total{outcome="kv"}')
    assert moved > 0, router.get_text("/metrics")
    assert _metric(router, 'tandem_router_migrations_total{outcome="failed"}') == 0
    assert _metric(router, "tandem_router_migration_seconds_count") == moved
    assert _metric(staying, "tandem_worker_migrations_in_total") == moved
    assert _metric(staying, "tandem_worker_migration_pulled_tokens_total") > 0
    assert _metric(staying, "tandem_worker_prefill_tokens_computed_total") == \
        computed_before[decode.index(staying)], "the staying worker recomputed what it should have pulled"


def test_kv_that_cannot_be_pulled_is_recomputed_with_the_same_text(group, toy_model_dir, model_name):
    # Its leases end at once: every pull of a migrated sequence's KV is refused.
    decode, router = _stack(group, toy_model_dir, "tcp", ("--kv-lease-s", "0"))
    expected = _undisturbed(router, model_name)
    computed_before = [_metric(w, "tandem_worker_prefill_tokens_computed_total") for w in decode]
    streams, leaving, staying = _sigterm_mid_stream(decode, router, model_name)
    assert streams.texts == expected, "a recomputed stream differs from the undisturbed run"
    assert leaving.proc.wait(60) == 0
    assert _metric(router, 'tandem_router_migrations_total{outcome="recompute"}') > 0, \
        router.get_text("/metrics") + router.log()[-4000:] + leaving.log()[-3000:]
    assert _metric(router, 'tandem_router_migrations_total{outcome="kv"}') == 0
    assert _metric(staying, "tandem_worker_migrations_in_total") == 0
    assert _metric(staying, "tandem_worker_prefill_tokens_computed_total") > computed_before[decode.index(staying)]
