"""The worker's HTTP server (aiohttp): the internal protocol of tandem.worker.protocol over the engine."""
