"""How a runtime runs a worker role: one role renderer per runtime (`base.py`, `registry.py`)."""
