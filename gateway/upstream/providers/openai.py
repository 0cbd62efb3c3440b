"""The `openai` provider kind: any OpenAI-compatible server (switchyard workers, vLLM, SGLang, hosted APIs).

One POST per request to `{endpoint}{path}`, the model renamed to the provider's upstream name, the
provider's key as `Authorization: Bearer`.
"""
from __future__ import annotations

from functools import partial

import aiohttp
from opentelemetry.trace import SpanKind

from gateway.config.gateway_config import ConfigError, ProviderConfig
from gateway.upstream.legs import Legs, leg_body
from gateway.upstream.mid_stream_resume import Stitcher
from gateway.upstream.providers.base import ProviderRun
from gateway.upstream.request import Leg, LegKind, Outcome, Progress, ProviderExhausted, Wire


def openai_wire(config: ProviderConfig) -> Wire:
    """Content-Type and the provider's key on every leg; the total limit covers the whole leg, the
    first-byte limit is enforced by `Legs.send`."""
    timeouts = config.timeouts
    return Wire(config.name, {"Content-Type": "application/json", **config.auth_headers()},
                aiohttp.ClientTimeout(total=timeouts.total_s, sock_connect=timeouts.connect_s,
                                      connect=timeouts.connect_s, sock_read=timeouts.quiet_s),
                timeouts.first_byte_s)


class OpenAIProvider:
    def __init__(self, config: ProviderConfig) -> None:
        if config.prefill_endpoints:
            raise ConfigError(f"providers.{config.name}.prefill_endpoints: only for kind switchyard-pd or vllm-pd")
        self.config = config
        self._wire = openai_wire(config)

    def start(self, progress: Progress, legs: Legs) -> ProviderRun:
        return partial(self._serve, progress, legs)

    async def _serve(self, progress: Progress, legs: Legs) -> Outcome:
        """One leg to the endpoint the model's policy picks among this provider's untried endpoints."""
        request = progress.request
        body = leg_body(self.config, request.body, request.raw, can_fail_over=progress.can_fail_over,
                        so_far=progress.so_far)
        if body is None:
            raise ProviderExhausted("cannot continue this answer from text")
        if progress.so_far is not None:
            progress.stitch = Stitcher(progress.so_far, request.api_path.endswith("chat/completions"), body[1],
                                      request.body)
        endpoint, decision, prefill_work = await legs.take(progress, self.config.name)
        with legs.tracing.span("upstream_attempt", SpanKind.CLIENT) as span:
            headers = legs.leg_headers(progress, span, self._wire, endpoint.endpoint_id, decision)
            leg = Leg(self._wire, endpoint, LegKind.SINGLE, request.api_path, body[0], headers,
                      prefill_work, request.facts.num_expected_output_tokens)
            return await legs.send(progress, leg, partial(legs.relay, progress, endpoint))
