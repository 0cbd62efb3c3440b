"""Speculative decoding: proposers draft tokens, the engine verifies them in one target forward."""
