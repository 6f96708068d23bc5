"""Where a worker process sits in its group (flags, LeaderWorkerSet's env), what a started rank's
command line is, and which groups a model's shape refuses before any rank starts."""

from __future__ import annotations

import pytest
from tandem.contracts.names import RENDEZVOUS_PORT
from tandem.worker.engine.parallel.node_ranks import follower_argv
from tandem.worker.engine.parallel.placement import place, split_address
from tandem.worker.engine.parallel.sharding import config_problem
from tandem.worker.server.config import WorkerConfig

LWS = {"LWS_LEADER_ADDRESS": "svc-0.svc.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}


def test_alone_on_a_node_rank_0_starts_the_rest():
    p = place(4, None, None, None, {})
    assert (p.rank, p.local_ranks, p.leader_port, list(p.started_ranks), p.spans_nodes) == (0, 4, 0, [1, 2, 3], False)
    assert place(1, None, None, None, LWS).local_ranks == 1  # no group: LWS's env means nothing


def test_leaderworkerset_env_places_each_pod():
    leader = place(4, None, None, None, LWS | {"LWS_WORKER_INDEX": "0"})
    worker = place(4, None, None, None, LWS)
    assert (leader.rank, worker.rank, worker.local_ranks, list(worker.started_ranks)) == (0, 2, 2, [3])
    assert (worker.leader_host, worker.leader_port) == ("svc-0.svc.ns", RENDEZVOUS_PORT)
    assert worker.spans_nodes
    # flags win over the environment: one process per rank, started by hand
    hand = place(4, 3, 1, "10.0.0.5:7000", LWS)
    assert (hand.rank, hand.local_ranks, hand.leader_host, hand.leader_port) == (3, 1, "10.0.0.5", 7000)


@pytest.mark.parametrize(("args", "env", "match"), [
    ((2, 1, None, None), {}, "needs --leader-address"),
    ((4, 1, 2, "h:1"), {}, "not the first of 2 ranks"),
    ((4, None, 3, "h:1"), {}, "3 ranks per node do not divide"),
    ((4, None, None, None), LWS | {"LWS_GROUP_SIZE": "3"}, "LWS_GROUP_SIZE=3"),
    ((2, None, None, "h:99999"), {}, "port must be"),
])
def test_inconsistent_groups_are_refused(args, env, match):
    with pytest.raises(ValueError, match=match):
        place(*args, env)


def test_addresses():
    assert split_address("leader") == ("leader", RENDEZVOUS_PORT)
    assert split_address("[fd00::1]:6000") == ("fd00::1", 6000)
    assert split_address("fd00::1") == ("fd00::1", RENDEZVOUS_PORT)


def test_a_started_rank_takes_its_place_and_network_and_nothing_else():
    cfg = WorkerConfig.from_values({"model": "/m", "tensor_parallel": 2, "role": "decode", "kv_backend": "tcp",
                                    "threads": 2, "num_blocks": 99}, "test")
    argv = follower_argv(cfg, 1, "127.0.0.1:4000", "cpu")
    flags = dict(zip(argv[4::2], argv[5::2], strict=True))
    assert flags["--rank"] == "1" and flags["--local-ranks"] == "1" and flags["--leader-address"] == "127.0.0.1:4000"
    assert flags["--port"] == "0" and flags["--kv-port"] == "0" and flags["--threads"] == "2"
    assert "--num-blocks" not in argv  # the pool's size (and every engine setting) comes from rank 0
    # what the started process makes of it (cli.py's parser, then WorkerConfig)
    import argparse

    from tandem.worker.server.cli import add_arguments, resolve_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    follower = resolve_settings(parser.parse_args(argv[4:]))
    assert (follower.placement.rank, follower.placement.size, follower.placement.leader_port) == (1, 2, 4000)
    assert follower.migrate_on_drain  # a decode rank serves its heads when its worker migrates


def test_model_shapes_that_cannot_split_are_named():
    toy = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    assert config_problem(toy, 2) is None and config_problem(toy, 4) is None
    assert "does not divide the model's 4 attention heads" in config_problem(toy, 3)
    assert "intermediate size 130" in config_problem(toy | {"intermediate_size": 130}, 4)
    assert "cannot share the model's 3 KV heads" in config_problem(
        {"num_attention_heads": 12, "num_key_value_heads": 3, "intermediate_size": 12}, 2)
