"""Benchmarks: `python -m bench <scenario>` from the repository root (bench/cli.py, bench/README.md).

Not part of the installed `tandem` package and not run by `make test`; `make bench` runs the
default scenarios.
"""
