"""Discrete-event simulation of the autoscaling planner against a day of traffic (issue 14)."""
