"""Issue 28.6 with two real gloo ranks: when rank 0's step raises after the step's first collective,
the ranks wait at different collectives. The group then fails at once on every rank (rank 0 closes
it, the follower's next collective fails, the follower leaves), not after --tp-timeout-s."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

_RANK = textwrap.dedent("""
    import sys, torch
    from tandem.worker.engine.model_runner import BatchItem
    from tandem.worker.engine.parallel.executor import LeaderRunner, StepLimits, follow
    from tandem.worker.engine.parallel.group import GroupFailed, GroupSpec, ParallelGroup, leave_process
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    spec = GroupSpec(2, rank, "127.0.0.1", port, timeout_s=900, startup_s=240, secret="s" * 32)
    group = ParallelGroup.join(spec, torch.device("cpu"))
    group.serving()

    class TwoCollectives:  # a step with two collectives; rank 0 raises between them
        def forward(self, items):
            group.all_reduce(torch.ones(4))
            if rank == 0:
                raise RuntimeError("a fault after the first collective")
            return group.all_reduce(torch.ones(4))

    try:
        if rank == 0:
            runner = LeaderRunner(TwoCollectives(), group, StepLimits(10, 16, 4, 4), beat_s=60)
            runner.forward([BatchItem([1], 0, [0], True)])
        else:
            follow(group, TwoCollectives())
        print("NO FAILURE")
    except GroupFailed as e:
        print("FAILED", e)
    finally:
        group.close()
    leave_process(0)  # as a worker's follower rank leaves: no finalising of the group's threads
""")


def test_rank_0s_error_after_the_first_collective_fails_both_ranks_now():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        # The group's timeout is 900 s: an answer within 400 s (start-up included, on a loaded machine)
        # is the fault failing the group, not the wait for the timeout.
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    assert outs[0][0].startswith("FAILED") and "a fault after the first collective" in outs[0][0]
    assert outs[1][0].startswith("FAILED"), outs[1]
