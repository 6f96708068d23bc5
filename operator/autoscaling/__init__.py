"""Autoscaling prefill and decode apart, against latency targets (issue 14): the operator's side.

The decision itself is pure and lives in tandem.planning.autoscaling (the planner, its readings,
snapshots and demands), which the simulator in bench/ drives too; here is what the operator adds:

spec.py      the typed `spec.autoscaling` API (declared in operator/spec/autoscaling.py), re-exported
status.py    decisions kept in status, read back for the renderer; the changes a decision makes
autoscaler.py  the I/O of a planning pass: scrape the pods, keep the window and state, decide
"""
