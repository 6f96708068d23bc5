"""Autoscaling prefill and decode apart, against latency targets (issue 14).

spec.py      the typed `spec.autoscaling` API and its OpenAPI schema (with CEL rules) for the CRD
scrape.py    one process's /metrics text -> typed cumulative readings (router, worker)
snapshot.py  two sets of readings -> a typed snapshot over a window (rates, percentiles, per role)
demands.py   what each role's load asks for, and what the planner learns (decode seats per pod)
planner.py   the decision: snapshot + current replicas + spec + its own state -> replicas and why
status.py    decisions kept in status, read back for the renderer; the changes a decision makes
autoscaler.py  the I/O of a planning pass: scrape the pods, keep the window and state, decide

Everything but autoscaler.py is pure (no clock, no I/O, no Kubernetes client): the operator scrapes,
keeps the state between calls and writes what the planner decides; the simulator in bench/ does the
same.
"""
