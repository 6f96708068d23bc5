"""Every contract that crosses a process boundary, defined once: roles, label and annotation names,
KV backends, the KV layout and health document, the worker API messages, route reasons, the
prefix-cache block hash and the JSON log format.

Standard library only: the operator, the router and the workers all import it, and the first two
must never load torch.
"""
