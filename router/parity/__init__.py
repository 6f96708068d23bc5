"""The handoff parity probe, in one place: the router proves each prefill/decode pairing before it
hands KV across it. decisions.py is pure (the probe's tokens, comparison, which pairing next, what a
result means), probe.py the I/O of one probe, checker.py runs them and serves GET /internal/parity.
The report both sides read is tandem.contracts.handoff_parity; the operator's read of it,
operator/router_parity.py."""
