"""The operator's planner, pure: autoscaling prefill and decode apart, against latency targets
(issue 14). The operator (tandem.operator.autoscaling) and the simulator (planning/simulation.py,
bench/) depend on it; it depends on nothing of theirs but the typed `spec.autoscaling` API
(tandem.operator.spec.autoscaling).

scrape.py    one process's /metrics text -> typed cumulative readings (router, worker)
snapshot.py  two sets of readings -> a typed snapshot over a window (rates, percentiles, per role)
demands.py   what each role's load asks for, and what the planner learns (decode seats per pod)
planner.py   the decision: snapshot + current replicas + spec + its own state -> replicas and why

No clock, no I/O, no Kubernetes client: the operator scrapes, keeps the state between calls and
writes what the planner decides; the simulator does the same.
"""
