"""Where the router learns which workers exist: a static list, or the Kubernetes API."""
