"""The GPU variant of the benchmark (one H200): see run_h200.sh."""
