"""What the scenarios share: processes, readiness, load generation, metrics, scraping, reports."""
