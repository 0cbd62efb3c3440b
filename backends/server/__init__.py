"""The worker's HTTP server: OpenAI-compatible endpoints and ops endpoints around one engine."""
