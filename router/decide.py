"""The request state machine as one pure step: `decide(journey, outcome, snapshot) -> action`.

Given what just happened to a request, `decide` updates the journey's record (its only effect:
its state and what it now counts on each worker, `Journey.charges`) and says what the driver does
next. It does no I/O: no awaits, no clock (time comes with the outcome), no metrics or logs (the
action carries them), nothing live: the routing policy it asks is a decision over the snapshot
(the workers, their cached prefixes, the round-robin cursor), so the same journey, outcome and
snapshot give the same action (tests/router/test_decide_gives_the_same_action_twice.py). Every
fault path is a plain function call in the tests (test_request_state_machine.py,
test_state_machine_migrates_streams.py).

The rules, state by state:
- arrived: a prompt of known size over `maxPromptTokens` fails (400) before any worker computes;
  the policy routes; nothing ready is a 503.
- prefill fails before the first token: another prefill worker the policy picks
  (`max_prefill_attempts` in all), then decode-side prefill (route `prefill_failed`); a busy one
  (429, or 503 with Retry-After) is not failed: route `prefill_saturated`, nothing to abort.
- prefilled: the client gets the first token at once; the decode worker gets the KV lease. With
  `hold_first_token` (`--first-token with-decode`) the first token is held instead and goes out
  ahead of whatever the request emits next (the decode worker's first token, or its end); an
  error ends it unsent. The tokens count as the client's for a resume either way.
- a decode worker fails (dies mid-stream, ends without a finish, refuses the handoff): its copy is
  aborted, a lease nobody pulled is freed, and another worker resumes with every token so far
  (`max_resumes`), else a 502; a worker that died after the last token `max_tokens` allowed is
  finished here.
- a decode worker is busy: another one of the KV's kv_compat gets the same KV lease; none of
  that kv_compat free, another decode worker recomputes (the lease freed), so KV never reaches
  another kv_compat's model; every one busy is a 503 with Retry-After while the client has
  nothing, else a wait for the soonest Retry-After (`busy_wait_s` in all) and the same choice.
- a decode worker leaves (a MIGRATE line): another ready decode worker of the same kv_compat
  pulls the KV it leased, else any by recompute; not a failure, and timed until the next token.
Handoff, resume and migration are one mechanism: the next worker gets the tokens so far and how
many characters the client has (Journey.worker_request), so nothing here trims text.
"""

from __future__ import annotations

import dataclasses
import logging

from tandem.contracts.names import Role
from tandem.contracts.protocol import EventType, FinishReason, StreamEvent
from tandem.contracts.routing import RouteReason
from tandem.router.actions import (
    Abort,
    Action,
    Blame,
    DecodeOn,
    EndWithError,
    Finish,
    Moved,
    PrefillOn,
    Read,
    Wait,
    Why,
    charges,
)
from tandem.router.errors import RouterError, no_worker, overloaded, upstream_failed
from tandem.router.journey import (
    Finished,
    Journey,
    Move,
    Phase,
    Rules,
    Started,
)
from tandem.router.outcomes import (
    Aborted,
    Arrived,
    CallFailed,
    Line,
    Outcome,
    Prefilled,
    Rejected,
    Waited,
)
from tandem.router.policies.base import RequestInfo, Snapshot, WorkerView
from tandem.router.validation import check_prompt_tokens
from tandem.router.worker_client import HandoffDiverged, WorkerBusy, WorkerFailed

INFO, WARNING = logging.INFO, logging.WARNING


def decide(j: Journey, outcome: Outcome, snap: Snapshot) -> Action:
    """The next action for journey `j` after `outcome`, choosing among `snap` (see the module
    docstring); `j.charges` then say what the request counts on each worker."""
    action = _step(j, outcome, snap)
    j.charges = charges(action, j.charges, j.route.decode.url if j.route is not None else None)
    if j.held and (action.emit or isinstance(action, EndWithError)):
        held, j.held = j.held, ()
        if not isinstance(action, EndWithError):
            action = dataclasses.replace(action, emit=(*held, *action.emit))
    return action


def _step(j: Journey, outcome: Outcome, snap: Snapshot) -> Action:
    match outcome:
        case Arrived():
            return _arrived(j, outcome, snap)
        case Rejected():
            return _fail(j, outcome.error)
        case Prefilled():
            return _prefilled(j, outcome)
        case CallFailed() if j.phase is Phase.PREFILL:
            return _prefill_failed(j, outcome, snap)
        case CallFailed():
            return _decode_failed(j, outcome, snap)
        case Aborted():
            return _after_abort(j, outcome, snap)
        case Line():
            return _line(j, outcome, snap)
        case Waited():
            return _waited(j, outcome, snap)
    raise TypeError(f"not an outcome: {outcome!r}")


# --- helpers -----------------------------------------------------------------------------------


def _rules(j: Journey) -> Rules:
    assert j.rules is not None, "a journey starts with Arrived"
    return j.rules


def _info(j: Journey) -> RequestInfo:
    assert j.info is not None, "a journey starts with Arrived"
    return j.info


def _fail(j: Journey, error: RouterError, **effects) -> EndWithError:
    j.phase = Phase.FAILED
    return EndWithError(error=error, **effects)


def _over_limit(j: Journey, prompt_tokens: int) -> RouterError | None:
    """The 400 for a prompt over `maxPromptTokens`, once its size is exact."""
    assert j.request is not None
    try:
        check_prompt_tokens(prompt_tokens, j.request, _rules(j).limits)
    except RouterError as err:
        return err
    return None


def _resume_choice(j: Journey, snap: Snapshot, exclude: set[str]) -> WorkerView | None:
    return _rules(j).policy.resume_decode(_info(j), snap, frozenset(exclude))


def _kv_choice(j: Journey, snap: Snapshot, exclude: set[str]) -> WorkerView | None:
    """A decode worker that may pull the journey's KV: only one of the kv_compat that computed it
    (another model's weights would read it as garbage, and cache it), never one a parity probe found
    disagreeing."""
    pool = [w for w in snap.workers if w.kv_compat == j.kv_compat and not w.parity_mismatch]
    return _resume_choice(j, snap.among(pool), exclude)


def _next_decode(j: Journey, snap: Snapshot, exclude: set[str]) -> tuple[WorkerView | None, tuple]:
    """The next decode worker and the aborts it takes: with the KV to one of its kv_compat; else
    any by recompute, the lease nobody will pull then freed; None: none free (the KV kept)."""
    if j.kv is None:
        return _resume_choice(j, snap, exclude), ()
    nxt = _kv_choice(j, snap, exclude)
    if nxt is not None:
        return nxt, ()
    nxt = _resume_choice(j, snap, exclude)
    if nxt is None:
        return None, ()
    holder = j.lease_holder
    j.clear_kv()
    return nxt, (holder,) if holder is not None else ()


def _moved(j: Journey, now: float) -> Moved | None:
    """The migration under way ends with this worker's first token (or its finish)."""
    if j.move is None:
        return None
    move, j.move = j.move, None
    return Moved(move.source, "kv" if j.kv is not None else "recompute", now - move.since)


# --- arrival and prefill -----------------------------------------------------------------------


def _arrived(j: Journey, o: Arrived, snap: Snapshot) -> Action:
    j.request, j.rules, j.info = o.request, o.rules, o.info
    j.prompt_ids = o.request.prompt_token_ids
    if o.info.prompt_token_ids is not None:  # exact already: refused before any worker computes
        err = _over_limit(j, o.info.prompt_tokens)
        if err is not None:
            return _fail(j, err)
    route = o.rules.policy.route(o.info, snap)
    if route is None:
        return _fail(j, no_worker("no worker is ready to serve this request; retry shortly."))
    j.route, j.route_reason = route, route.reason
    if route.prefill is not None:
        j.phase = Phase.PREFILL
        return _prefill_on(j, route.prefill, Why.ROUTED, route=route, turns=(Role.PREFILL, Role.DECODE))
    j.phase = Phase.DECODE
    return _decode_on(j, route.decode, Why.ROUTED, route=route, route_reason=j.route_reason, turns=(Role.DECODE,))


def _prefill_on(j: Journey, worker: WorkerView, why: Why, **effects) -> PrefillOn:
    route = j.route
    assert route is not None
    j.prefill_attempts += 1
    j.target = worker
    j.touch(worker.url)
    j.prefill_url = worker.url
    work = _info(j).prompt_tokens - (route.cached_prefill_tokens if worker is route.prefill else 0)
    return PrefillOn(worker=worker, work=work, why=why, **effects)


def _prefill_failed(j: Journey, o: CallFailed, snap: Snapshot) -> Action:
    route = j.route
    assert route is not None
    busy = isinstance(o.error, WorkerBusy)
    j.route_reason = RouteReason.PREFILL_SATURATED if busy else RouteReason.PREFILL_FAILED
    effects = {"blame": Blame(o.url, "prefill", o.error), "abort": () if busy else (o.url,)}
    j.prefill_tried.add(o.url)
    nxt = _rules(j).policy.retry_prefill(_info(j), route, snap, frozenset(j.prefill_tried))
    if nxt is not None and j.prefill_attempts < _rules(j).max_prefill_attempts:
        note = (INFO, f"request {j.request_id}: retrying prefill on {nxt.url} (attempt {j.prefill_attempts + 1})")
        return _prefill_on(j, nxt, Why.RETRY, notes=(note,), turns=(Role.PREFILL,), **effects)
    j.prefill_url = None
    j.phase = Phase.DECODE
    return _decode_on(j, route.decode, Why.FALLBACK, route_reason=j.route_reason, **effects)


def _prefilled(j: Journey, o: Prefilled) -> Action:
    route, res = j.route, o.result
    assert route is not None
    j.route_reason = route.reason
    if res.kv is not None:  # freeing that lease early (an abort) needs its token
        j.lease_tokens[o.url] = res.kv.lease_token
    j.prompt_ids, j.prompt_tokens = res.prompt_token_ids, len(res.prompt_token_ids)
    err = _over_limit(j, j.prompt_tokens)
    if err is not None:
        return _fail(j, err, route_reason=j.route_reason)
    first_lp = [res.first_token_logprobs] if res.first_token_logprobs else None
    emit = (Started(j.prompt_tokens), j.tokens([res.first_token_id], res.first_token_text, first_lp))
    if res.finish_reason is not None:
        j.phase = Phase.FINISHED
        return Finish(emit=(*emit, Finished(res.finish_reason.value, j.prompt_tokens, 1)), route_reason=j.route_reason)
    j.phase = Phase.DECODE
    if res.kv is not None:
        assert j.target is not None
        j.kv, j.lease_holder, j.kv_compat = res.kv, o.url, j.target.kv_compat
    if _rules(j).hold_first_token:
        j.held, emit = emit, ()
    return _decode_on(j, route.decode, Why.ROUTED, emit=emit, route_reason=j.route_reason)


# --- decode ------------------------------------------------------------------------------------


def _decode_on(j: Journey, worker: WorkerView, why: Why, **effects) -> DecodeOn:
    j.target = worker
    j.touch(worker.url)
    j.decode_url = worker.url
    # a decode-side prefill: the prompt waits there until its first token (load-aware routing)
    queued = _info(j).prompt_tokens if j.kv is None and not j.generated else 0
    return DecodeOn(worker=worker, queued=queued, why=why, **effects)


def _finish(j: Journey, now: float, **effects) -> Finish:
    moved = effects.pop("moved", None) or _moved(j, now)  # the last worker finished without a token
    j.phase = Phase.FINISHED
    done = Finished(j.finish_reason, j.prompt_tokens or 0, len(j.generated))
    return Finish(emit=(*effects.pop("emit", ()), done), moved=moved, **effects)


def _started(j: Journey, prompt_tokens: int) -> Started | RouterError:
    j.prompt_tokens = prompt_tokens
    return _over_limit(j, prompt_tokens) or Started(prompt_tokens)


def _line(j: Journey, o: Line, snap: Snapshot) -> Action:
    ev = o.event
    if ev.type is EventType.HEARTBEAT:  # queued there: alive, nothing to pass on
        return Read()
    if ev.type is EventType.MIGRATE:  # it is leaving: every token so far came before this
        return _migrate(j, o, snap)
    if ev.type is EventType.ERROR:
        err = ev.error or {}
        if err.get("type") == "invalid_request_error" and not j.generated:
            return _fail(j, RouterError.from_body(400, {"error": err}))
        return _decode_failed(j, _failure(o, f"decode on {o.url}: {err.get('message')}"), snap)
    if ev.type is EventType.START:
        if j.prompt_tokens is not None or ev.prompt_tokens is None:
            return Read()
        started = _started(j, ev.prompt_tokens)
        return _fail(j, started) if isinstance(started, RouterError) else Read(emit=(started,))
    return _output(j, o, ev, snap)


def _output(j: Journey, o: Line, ev: StreamEvent, snap: Snapshot) -> Action:
    """A TOKEN or FINISH line: what it adds to the client's text, and whether the stream is over."""
    emit: list = []
    if j.prompt_tokens is None:  # a worker that sent no START
        started = _started(j, (ev.usage or {}).get("prompt_tokens", 0))
        if isinstance(started, RouterError):
            return _fail(j, started)
        emit.append(started)
    moved = None
    if ev.token_ids or ev.text:
        emit.append(j.tokens(list(ev.token_ids), ev.text, ev.logprobs or None))
        moved = _moved(j, o.now)
    if ev.type is not EventType.FINISH:
        return Read(emit=tuple(emit), moved=moved)
    reason = ev.finish_reason or FinishReason.STOP
    if reason in (FinishReason.ABORT, FinishReason.ERROR):
        return _decode_failed(j, _failure(o, f"decode on {o.url} ended with {reason}"), snap, emit=tuple(emit),
                              moved=moved)
    j.finish_reason = reason.value
    return _finish(j, o.now, emit=tuple(emit), moved=moved)


def _failure(o: Line, message: str) -> CallFailed:
    return CallFailed(o.url, WorkerFailed(message, dead=False), now=o.now)


def _decode_failed(j: Journey, o: CallFailed, snap: Snapshot, **effects) -> Action:
    blame = Blame(o.url, "decode", o.error)
    if isinstance(o.error, WorkerBusy):  # it refused before streaming: the KV lease is still there
        j.busy[o.url] = o.error.retry_after_s
        return _after_busy(j, o, snap, blame=blame, **effects)
    j.failures += 1
    j.failure = o.error
    if isinstance(o.error, HandoffDiverged):  # its prefix cache may now hold the wrong KV under our blocks
        j.cache_apart = True
    if not o.error.dead:  # it may get the resume: its copy (same request id) must be gone first
        return Abort(url=o.url, blame=blame, **effects)
    j.excluded.add(o.url)
    return _after_abort(j, o, snap, blame=blame, abort=(o.url,), **effects)


def _after_abort(j: Journey, o: Outcome, snap: Snapshot, **effects) -> Action:
    """After decode failed: the lease a handoff did not pull freed, and the worker to resume on;
    finished when every token was generated already; too many failures, or none left, is a 502."""
    abort = effects.pop("abort", ())
    if j.kv is not None and j.lease_holder is not None:
        abort = (*abort, j.lease_holder)
    j.clear_kv()
    assert j.request is not None
    if len(j.generated) >= j.request.sampling.max_tokens:  # it died between its last token and its finish
        j.finish_reason = FinishReason.LENGTH.value
        return _finish(j, o.now, abort=abort, **effects)
    nxt = _resume_choice(j, snap, j.excluded)
    if j.failures > _rules(j).max_resumes or nxt is None:
        note = (WARNING, f"request {j.request_id}: giving up after {j.failures} decode failures: {j.failure}")
        return _fail(j, upstream_failed("the decode worker failed and no other could resume the request"),
                     abort=abort, notes=(note,), **effects)
    note = (INFO, f"request {j.request_id}: resuming on {nxt.url} after {len(j.generated)} tokens")
    return _decode_on(j, nxt, Why.RESUME, abort=abort, notes=(note,), turns=(Role.DECODE,), **effects)


def _after_busy(j: Journey, o: Outcome, snap: Snapshot, **effects) -> Action:
    """The next decode worker once busy ones refused: one that has not, else (every one busy) a 503
    with Retry-After while the client has nothing yet, else a wait for the soonest Retry-After
    and another round, within `busy_wait_s` in all."""
    nxt, abort = _next_decode(j, snap, j.excluded | j.busy.keys())
    if nxt is not None:
        return _decode_on(j, nxt, Why.RETRY, abort=abort, turns=(Role.DECODE,), **effects)
    wait = min(j.busy.values())
    if j.prompt_tokens is None:  # nothing sent yet: the client can come back later
        return _fail(j, overloaded(wait), **effects)
    if j.busy_deadline is None:
        j.busy_deadline = o.now + _rules(j).busy_wait_s
    if o.now + wait > j.busy_deadline:
        return _fail(j, overloaded(wait, "every decode worker stayed busy"), **effects)
    note = (INFO, f"request {j.request_id}: every decode worker is busy; retrying in {wait:.1f} s")
    return Wait(seconds=wait, notes=(note,), **effects)


def _waited(j: Journey, o: Waited, snap: Snapshot) -> Action:
    j.busy.clear()
    nxt, abort = _next_decode(j, snap, j.excluded)
    if nxt is None:
        return _fail(j, no_worker("no decode worker is ready to continue this request; retry shortly."))
    return _decode_on(j, nxt, Why.RETRY, abort=abort, turns=(Role.DECODE,))


def _migrate(j: Journey, o: Line, snap: Snapshot) -> Action:
    """Where a request goes when its decode worker leaves: another ready decode worker of the same
    kv_compat with the KV it leased, else any decode-capable one by recompute. No worker left is
    a 502 (the stream has started)."""
    source, kv, notes = o.url, o.event.kv, []
    assert j.target is not None
    j.move = j.move or Move(source, o.now)
    j.excluded.add(source)  # never back to the worker that is leaving
    j.clear_kv()
    if kv is not None:
        j.lease_tokens[source] = kv.lease_token  # an abort there (the request ends early) frees it
        if o.event.generated_token_ids == j.generated:
            j.kv, j.lease_holder, j.kv_compat = kv, source, j.target.kv_compat
        else:
            notes.append((WARNING, f"request {j.request_id}: MIGRATE from {source} lists "
                                   f"{len(o.event.generated_token_ids)} tokens, the client has "
                                   f"{len(j.generated)}: recomputing"))
    nxt, _ = _next_decode(j, snap, j.excluded)
    # a lease there that nobody will pull (no worker, another kv_compat, tokens that disagree): free it now
    abort = (source,) if kv is not None and (nxt is None or j.kv is None) else ()
    if nxt is None:
        return _fail(j, upstream_failed("the decode worker serving this request shut down and no other is "
                                        "ready to continue it"), abort=abort, notes=tuple(notes))
    notes.append((INFO, f"request {j.request_id}: {source} is leaving; migrating to {nxt.url} after "
                        f"{len(j.generated)} tokens ({'pulling its KV' if j.kv is not None else 'recomputing'})"))
    return _decode_on(j, nxt, Why.MIGRATE, abort=abort, notes=tuple(notes), turns=(Role.DECODE,))
