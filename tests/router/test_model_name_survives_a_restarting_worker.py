"""Found by the chaos soak (`python -m bench chaos`, BENCHMARKS.md): while one worker restarts, the
router answers every request 404 model_not_found.

A worker that is still loading answers /internal/info with `model: ""` (and `ready: false`), and
`WorkerSet.model()` takes the model of the first worker with any info, ready or not; the request's
model is then checked against "" (router/app.py, check_model). In the soak's 10 minutes, 699 of 1018
requests got that 404 while a prefill worker restarted, though the other workers served the model: a
client treats 404 model_not_found as final, not as something to retry. Issue 21 item 11 is the same
cause seen from /v1/models. Fixed there: a worker that reports no model name is not asked for it.
"""

import dataclasses

from tandem.contracts.names import Role
from tandem.router.workers import Target, WorkerSet
from tandem.testing.fake_workers import FakeWorkers


async def test_a_worker_still_loading_does_not_hide_the_served_model():
    fake = FakeWorkers()
    starting = fake.add("http://prefill-0", Role.PREFILL)
    serving = fake.add("http://decode-0", Role.DECODE)
    # what /internal/info answers while the model loads (worker/server/app.py: info)
    fake.infos[starting] = dataclasses.replace(fake.infos[starting], model="", ready=False, max_model_len=0)
    pool = WorkerSet(fake)
    pool.set_targets([Target(starting), Target(serving)])
    await pool.poll_once()
    assert pool.model() == "toy"
