"""The `openai` provider kind: any OpenAI-compatible server (switchyard workers, vLLM, SGLang, hosted APIs).

One POST per request to `{endpoint}{path}`, the model renamed to the provider's upstream name, the
provider's key as `Authorization: Bearer`.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
import orjson

from gateway.config import ConfigError, ProviderConfig
from gateway.legs import Job, LegOutcome, LegRequest, LegRunner, ProviderExhausted


class OpenAIProvider:
    def __init__(self, config: ProviderConfig, *, pools_checked: bool = False) -> None:
        if config.prefill_endpoints and not pools_checked:
            raise ConfigError(f"providers.{config.name}.prefill_endpoints: only for kind switchyard-pd")
        self.config = config
        self._auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        # The total limit covers the whole leg; first-byte is enforced by the dispatcher.
        self._timeout = aiohttp.ClientTimeout(total=config.timeouts.total_s, sock_connect=config.timeouts.connect_s,
                                              connect=config.timeouts.connect_s)

    async def attempt(self, legs: LegRunner, job: Job) -> LegOutcome:
        """One leg to the endpoint the model's policy picks among this provider's untried endpoints."""
        policy = legs.parts.policies[job.routed.model.name]
        chosen = legs.choose(job, legs.parts.registry.pool(self.config.name), policy)
        if chosen is None:
            raise ProviderExhausted("no eligible endpoint left")
        endpoint, decision = chosen
        return await legs.single_leg(job, self, endpoint, decision, policy)

    def encode_body(self, body: Mapping[str, Any], raw: bytes) -> bytes:
        model = self.config.upstream_model
        if model is None or body.get("model") == model:
            return raw
        return orjson.dumps({**body, "model": model})

    def open(self, session: aiohttp.ClientSession, endpoint_id: str, leg: LegRequest,
             body: bytes) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        headers = {"Content-Type": "application/json", **leg.headers, **self._auth}
        return session.post(endpoint_id + leg.path, data=body, headers=headers, timeout=self._timeout)
