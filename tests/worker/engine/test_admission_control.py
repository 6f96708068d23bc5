"""Admission control on its own, over plain sets: an id in use anywhere (claimed, or held by the
engine) is refused 409; the requests waiting for a seat (queued and claimed) are bounded beyond the
free seats, 429 with a retry hint; a claim ends when its request is queued or given up."""

from __future__ import annotations

import pytest
from tandem.worker.engine.admission import AdmissionControl
from tandem.worker.engine.errors import RequestError


class Engine:
    """What admission reads of an engine: the ids it holds, how many run and how many are queued."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.running = 0
        self.queued = 0

    def control(self, max_num_seqs: int = 2, max_waiting: int = 1) -> AdmissionControl:
        return AdmissionControl(max_num_seqs, max_waiting, in_use=self.held.__contains__,
                                load=lambda: (self.running, self.queued))


def _refused(fn, status: int, code: str) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn()
    assert (e.value.status, e.value.code) == (status, code)
    return e.value


def test_ids_are_unique_across_claims_and_what_the_engine_holds():
    eng = Engine()
    adm = eng.control(max_num_seqs=8)
    adm.claim("a")
    _refused(lambda: adm.claim("a"), 409, "duplicate_request_id")
    eng.held.add("b")
    _refused(lambda: adm.claim("b"), 409, "duplicate_request_id")
    _refused(lambda: adm.take("b"), 409, "duplicate_request_id")  # unclaimed: admitted at the queue
    adm.take("a")  # queued: the claim ended, the id is the engine's now
    assert "a" not in adm and adm.num_claims == 0
    adm.claim("c")
    adm.unclaim("c")
    adm.unclaim("c")  # a second time changes nothing
    adm.claim("c")


def test_the_wait_is_bounded_beyond_the_free_seats_claims_included():
    eng = Engine()
    adm = eng.control(max_num_seqs=2, max_waiting=1)
    adm.claim("1")
    adm.claim("2")
    adm.claim("3")  # two free seats and one waiting place
    err = _refused(lambda: adm.claim("4"), 429, "queue_full")
    assert err.retry_after_s is not None and err.type == "service_unavailable"
    adm.unclaim("3")
    eng.running, eng.queued = 2, 0  # "1" and "2" run now: one waiting place, no seat
    adm.take("1")
    adm.take("2")
    adm.claim("5")
    _refused(lambda: adm.claim("6"), 429, "queue_full")
    eng.running = 3  # more running than seats (a worker that was just resized) never goes negative
    _refused(lambda: adm.claim("6"), 429, "queue_full")
