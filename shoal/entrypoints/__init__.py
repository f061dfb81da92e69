"""Ways to run shoal as a service: the OpenAI-compatible HTTP server (`shoal serve`)."""
