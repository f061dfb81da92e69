"""The OpenAI-compatible HTTP server: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
plus `/health`, `/metrics`, `/tokenize`, `/detokenize` and `/version`."""
