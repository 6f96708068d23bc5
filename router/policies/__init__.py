"""Routing policies: the interface (base.py), the registry of names (registry.py) and one module per
policy, imported only when a router is configured to use it."""
