"""KV-cache events: what an engine's prefix cache gained and lost, published for routers
(see docs/routing.md)."""
