"""How the router reaches a runtime's workers: one worker client per runtime (`registry.py`)."""
