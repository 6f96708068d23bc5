"""Tensor parallelism: a worker as a group of ranks, one process per device (README.md here)."""
