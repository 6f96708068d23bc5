"""The tensor-parallel rendezvous is no door into the worker (issue 28.1): rank 0's store listens on
the leader address alone, and what the ranks read from it, or from rank 0's step broadcast, is JSON
sealed with the service's internal secret. A value that a stranger wrote first (a pickle that would
run code) is refused by the real rank code in a process of its own, and its code never runs."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from tandem.worker.engine.parallel.agreement import Agreement
from tandem.worker.engine.parallel.group import GroupSpec, ParallelGroup, make_store
from tandem.worker.engine.parallel.wire import SealBroken, seal, unseal

SECRET = "s" * 32


def _listening_addresses(port: int) -> set[str]:
    me = psutil.Process()
    return {c.laddr.ip for c in me.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
            and c.laddr.port == port}


def test_the_store_listens_on_the_leader_address_only():
    store = make_store(GroupSpec(2, 0, "127.0.0.1", 0, startup_s=10))
    assert _listening_addresses(store.port) == {"127.0.0.1"}  # not 0.0.0.0 / ::
    del store


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


_READ_AGREEMENT = textwrap.dedent("""
    import json, sys, torch
    from tandem.worker.engine.parallel.follower import read_agreement
    from tandem.worker.engine.parallel.group import GroupFailed, GroupSpec, ParallelGroup, make_store
    port, secret = int(sys.argv[1]), sys.argv[2] or None
    spec = GroupSpec(2, 1, "127.0.0.1", port, startup_s=20, secret=secret)
    group = ParallelGroup(spec, torch.device("cpu"), make_store(spec))
    try:
        a = read_agreement(group)
        print(json.dumps({"engine_id": a.engine_id, "engine": a.engine}))
    except GroupFailed as e:
        print("REFUSED", e)
    finally:
        group.close()
""")


def _rank_1_reads_agreement(port: int, secret: str | None) -> str:
    out = subprocess.run([sys.executable, "-c", _READ_AGREEMENT, str(port), secret or ""], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _agreement() -> Agreement:
    return Agreement(engine={"model": "/m", "num_blocks": 64}, max_context=256, engine_id="e-1",
                     leader_url="http://127.0.0.1:1", role="decode", kv_backend="tcp")


@pytest.fixture
def leader_store():
    store = make_store(GroupSpec(2, 0, "127.0.0.1", 0, startup_s=30))
    yield store
    del store


def _stranger(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)


def test_a_pickle_a_stranger_wrote_first_is_refused_and_never_runs(leader_store, tmp_path: Path):
    marker = tmp_path / "ran"
    _stranger(leader_store.port).set("tandem/agreement/0", pickle.dumps(_Evil(str(marker))))
    out = _rank_1_reads_agreement(leader_store.port, SECRET)
    assert out.startswith("REFUSED") and "not sealed with this service's internal secret" in out
    assert not marker.exists()


def test_a_value_sealed_with_another_secret_is_refused(leader_store):
    leader_store.set("tandem/agreement/0", seal(_agreement(), "x" * 32))
    out = _rank_1_reads_agreement(leader_store.port, SECRET)
    assert out.startswith("REFUSED") and "agreement" in out


def test_rank_0s_sealed_agreement_reaches_rank_1(leader_store):
    group = ParallelGroup(GroupSpec(2, 0, "127.0.0.1", leader_store.port, secret=SECRET), None, leader_store)
    group.publish("agreement", _agreement())
    out = json.loads(_rank_1_reads_agreement(leader_store.port, SECRET))
    assert out == {"engine_id": "e-1", "engine": {"model": "/m", "num_blocks": 64}}


def test_a_seal_is_checked_before_any_json_is_read():
    sealed = seal({"kind": "step", "items": []}, SECRET)
    assert unseal(sealed, SECRET, "x") == {"kind": "step", "items": []}
    with pytest.raises(SealBroken):
        unseal(sealed[:-1] + b"]", SECRET, "x")  # one byte changed
    with pytest.raises(SealBroken):
        unseal(sealed, None, "x")
    with pytest.raises(SealBroken):
        unseal(b"short", SECRET, "x")


_BROADCAST = textwrap.dedent("""
    import faulthandler, sys, torch
    faulthandler.enable()  # an abort at exit prints every thread's stack
    from tandem.worker.engine.parallel.executor import Kind, Message
    from tandem.worker.engine.parallel.group import GroupFailed, GroupSpec, ParallelGroup, leave_process
    from tandem.worker.engine.model_runner import BatchItem
    rank, port, secret = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    spec = GroupSpec(2, rank, "127.0.0.1", port, timeout_s=20, startup_s=240, secret=secret)
    group = ParallelGroup.join(spec, torch.device("cpu"))
    try:
        if rank == 0:
            group.broadcast(Message(Kind.STEP, [BatchItem([5, 6], 3, [7], True)]).to_json())
            print("SENT")
        else:
            print(Message.from_json(group.broadcast()))
    except GroupFailed as e:
        print("REFUSED", e)
    finally:
        group.close()
    leave_process(0)  # as a worker's follower rank leaves: no finalising of the group's threads
""")


@pytest.mark.parametrize("follower_secret", [SECRET, "y" * 32])
def test_a_step_broadcast_is_opened_only_with_the_groups_secret(follower_secret):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _BROADCAST, str(rank), str(port), secret],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, secret in ((0, SECRET), (1, follower_secret))]
    outs = [p.communicate(timeout=400) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert outs[0][0].strip() == "SENT"
    if follower_secret == SECRET:
        assert "BatchItem(token_ids=[5, 6], start=3, block_table=[7], sample=True)" in outs[1][0]
    else:
        assert outs[1][0].startswith("REFUSED") and "not sealed" in outs[1][0]
