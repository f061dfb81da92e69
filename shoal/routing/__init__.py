"""Routing requests over engine replicas: by cached prefix (KV-cache events), load and session
(see docs/routing.md)."""
