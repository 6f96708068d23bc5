"""A worker that turns ready has moved its start-up heap (model, engine, compiled graphs) out of the
garbage collector's walks: a full collection over it stalls every stream (330 ms for the
benchmark model), so later collections must walk only what requests create."""

from __future__ import annotations

import gc


def _walked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


async def test_ready_worker_has_frozen_its_engine_out_of_the_collector(start_worker):
    gc.unfreeze()
    try:
        w = await start_worker(attach=False)
        assert _walked(w.engine) and _walked(w.engine.runner)
        await w.serve()
        assert (await w.client.get("/ready")).status == 200
        assert gc.get_freeze_count() > 0
        assert not _walked(w.engine) and not _walked(w.engine.runner)
    finally:
        gc.unfreeze()
