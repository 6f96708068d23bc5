"""The transformers path: transformers model classes with Tandem's paged attention plugged in."""
