"""What a provider kind offers the dispatcher: one attempt at serving a routed request (one leg, or
several, composed from the building blocks in gateway/legs.py), plus its upstream wire details
(URL layout, auth header, model name). A provider does not walk the chain or retry.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import aiohttp

from gateway.config import ProviderConfig
from gateway.legs import Job, LegOutcome, LegRequest, LegRunner

__all__ = ["LegRequest", "Provider"]


class Provider(Protocol):
    config: ProviderConfig

    async def attempt(self, legs: LegRunner, job: Job) -> LegOutcome:
        """Serve `job` once. Raises `RetryableFailure` when a leg failed before the client got a byte
        (the dispatcher retries, here or further down the chain) and `ProviderExhausted` when this
        provider has no endpoint left to try for the request."""
        ...

    def encode_body(self, body: Mapping[str, Any], raw: bytes) -> bytes:
        """The upstream body: `raw` (the client's bytes) unless this provider changes something (model name)."""
        ...

    def open(self, session: aiohttp.ClientSession, endpoint_id: str, leg: LegRequest,
             body: bytes) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        """Send one leg; the context manager closes the upstream connection on exit."""
        ...
