"""What a provider kind must offer the dispatcher: turn a routed request into one upstream leg.

A provider owns the upstream wire details (URL layout, auth header, model name); it does not
choose endpoints, retry, or relay bytes.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from gateway.config import ProviderConfig


@dataclass(frozen=True, slots=True)
class LegRequest:
    path: str                       # API path, e.g. "/v1/chat/completions"
    body: Mapping[str, Any]         # the client's parsed body (never mutated)
    stream: bool                    # the client asked for SSE
    headers: Mapping[str, str]      # x-request-id, traceparent: forwarded upstream


class Provider(Protocol):
    config: ProviderConfig

    def encode_body(self, body: Mapping[str, Any], raw: bytes) -> bytes:
        """The upstream body: `raw` (the client's bytes) unless this provider changes something (model name)."""
        ...

    def open(self, session: aiohttp.ClientSession, endpoint_id: str, leg: LegRequest,
             body: bytes) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        """Send one leg; the context manager closes the upstream connection on exit."""
        ...
