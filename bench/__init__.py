"""Benchmarks: colocated against disaggregated serving, side by side (`make bench`).

Not part of the installed `tandem` package and not run by `make test`: `python -m bench.run`
from the repository root.
"""
