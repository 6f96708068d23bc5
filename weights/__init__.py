"""Model weights: resolving a hub revision, reading config.json, downloading once (tandem.weights)."""
