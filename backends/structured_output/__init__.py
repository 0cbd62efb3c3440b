"""Structured output: the JSON grammar (JSON mode, JSON schema) and the per-token masks the sampler applies."""
