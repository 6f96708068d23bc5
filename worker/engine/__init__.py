"""The model runtime: a paged-KV engine with continuous batching (see engine.py for the entry point)."""
