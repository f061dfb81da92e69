"""Prefill/decode disaggregation on Ray: engine actors and the proxy (docs/disaggregation.md)."""
