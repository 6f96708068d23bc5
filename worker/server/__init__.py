"""The worker's HTTP server (aiohttp): the internal protocol of tandem.contracts.protocol over the engine."""
