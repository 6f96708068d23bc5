"""SIGTERM to a decode worker under load, as Kubernetes sends a pod it removes: real worker and router
processes on loopback (toy model, fp32, greedy, ignore_eos). Streams running on that worker move to
the other decode worker by KV transfer (decode to decode, over the tcp or NIXL handoff); every
stream completes without an error with exactly the text of an undisturbed run; the router counts
the migrations by outcome and the destination pulled the KV instead of recomputing it. When the
KV cannot be pulled (the leaving worker's lease is gone before the pull), the stream still
completes, identically, by recompute.
"""

from __future__ import annotations

import contextlib
import signal

import pytest
from tandem.testing.completion_streams import CompletionStreams, undisturbed
from tandem.testing.router_process import RouterProcess
from tandem.testing.worker_process import WorkerProcess
from tandem.worker.local.processes import Supervisor

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STREAMS = 6
# The streams' progress is read from the client's side, which can lag the engine's by hundreds of
# tokens on a loaded machine (a fresh clone once saw the engine finish every stream, 160 tokens, while
# the client had read fewer than 80 of one: nothing left to hand over). Long answers keep the engine
# busy well past what the client has read.
MAX_TOKENS = 480
TOKENS_BEFORE_SIGTERM = 12
PROMPTS = [f"Stream {i}: the operator scales the decode pool down while tokens keep flowing." for i in range(STREAMS)]


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


@contextlib.contextmanager
def _frozen(workers: list):
    """SIGSTOP the workers (no stream moves on meanwhile) and SIGCONT them after: a signal sent to
    one meanwhile is handled as it resumes, before its engine can finish another stream."""
    for w in workers:
        w.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for w in workers:
            w.signal(signal.SIGCONT)


def _worker_running(streams: CompletionStreams, decode: list, busy: set) -> tuple[object, object, int]:
    """(a decode worker whose engine still runs one of the unfinished streams, the other one, that
    stream's chunks as the client has read them): the least advanced such stream. The client's view
    lags the engine's by hundreds of tokens on a loaded machine, so a stream the client has not seen
    end may be over in its engine (a fresh clone once SIGTERMed a worker with nothing left to hand
    over); the engine's side is read from the workers' logs (each request started and finished) and
    from `busy`, the workers that reported running sequences just before they were frozen."""
    unfinished = sorted((c, i) for i, c in enumerate(streams.chunks) if streams.finish[i] is None)
    assert unfinished, "every stream finished before the SIGTERM: nothing to migrate"
    for chunks, i in unfinished:
        rid = streams.ids[i].split("-", 1)[1]
        holders = [w for w in decode if f"generate started request_id={rid}" in w.log()]
        assert len(holders) == 1, f"stream {i} ({rid}) started on {len(holders)} decode workers"
        if holders[0] in busy and f"generate finished request_id={rid}" not in holders[0].log():
            return holders[0], next(w for w in decode if w is not holders[0]), chunks
    raise AssertionError("every stream had ended in its engine before the SIGTERM: nothing to migrate")


def _sigterm_mid_stream(decode: list, router, model: str) -> tuple[CompletionStreams, object, object]:
    """Start the streams; once each has tokens, SIGTERM a decode worker whose engine still runs one
    of them while both decode workers are frozen, so that stream is still mid-flight when the
    worker hands its sequences out, however the machine's load spread the streams' progress. The
    streams, the worker that left and the one that stayed."""
    streams = CompletionStreams(router.url, model, PROMPTS, MAX_TOKENS, timeout_s=120)
    streams.wait(lambda: min(streams.chunks) >= TOKENS_BEFORE_SIGTERM, 120, "every stream's first tokens")
    busy = {w for w in decode if w.metric("tandem_worker_running_sequences") > 0}
    with _frozen(decode):
        leaving, staying, _ = _worker_running(streams, decode, busy)
        leaving.signal(signal.SIGTERM)
    streams.join()  # every stream ended by max_tokens, none with an error
    return streams, leaving, staying


def test_sigterm_moves_running_streams_by_kv_transfer(group, toy_model_dir, model_name, backend):
    decode, router = _stack(group, toy_model_dir, backend)
    expected = undisturbed(router.url, model_name, PROMPTS, MAX_TOKENS, timeout_s=120)
    computed_before = [w.metric("tandem_worker_prefill_tokens_computed_total") for w in decode]
    streams, leaving, staying = _sigterm_mid_stream(decode, router, model_name)
    assert streams.texts == expected, "a migrated stream differs from the undisturbed run"
    assert leaving.proc.wait(60) == 0, leaving.log()[-3000:]
    assert "draining: handing" in leaving.log()
    moved = router.metric('tandem_router_migrations_total{outcome="kv"}')
    assert moved > 0, router.get_text("/metrics")
    assert router.metric('tandem_router_migrations_total{outcome="failed"}') == 0
    assert router.metric("tandem_router_migration_seconds_count") == moved
    assert staying.metric("tandem_worker_migrations_in_total") == moved
    assert staying.metric("tandem_worker_migration_pulled_tokens_total") > 0
    assert staying.metric("tandem_worker_prefill_tokens_computed_total") == \
        computed_before[decode.index(staying)], "the staying worker recomputed what it should have pulled"


def test_kv_that_cannot_be_pulled_is_recomputed_with_the_same_text(group, toy_model_dir, model_name):
    # Its leases end at once: every pull of a migrated sequence's KV is refused.
    decode, router = _stack(group, toy_model_dir, "tcp", ("--kv-lease-s", "0"))
    expected = undisturbed(router.url, model_name, PROMPTS, MAX_TOKENS, timeout_s=120)
    computed_before = [w.metric("tandem_worker_prefill_tokens_computed_total") for w in decode]
    streams, leaving, staying = _sigterm_mid_stream(decode, router, model_name)
    assert streams.texts == expected, "a recomputed stream differs from the undisturbed run"
    assert leaving.proc.wait(60) == 0
    assert router.metric('tandem_router_migrations_total{outcome="recompute"}') > 0, \
        router.get_text("/metrics") + router.log()[-4000:] + leaving.log()[-3000:]
    assert router.metric('tandem_router_migrations_total{outcome="kv"}') == 0
    assert staying.metric("tandem_worker_migrations_in_total") == 0
    assert staying.metric("tandem_worker_prefill_tokens_computed_total") > computed_before[decode.index(staying)]
