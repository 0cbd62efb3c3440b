"""The records that describe one generation request on its way through the gateway: what the client
asked for (`RoutedRequest`), how serving it goes (`Progress`), one upstream call (`Leg`, sent the way a
provider's `Wire` says) and what comes back (`Outcome`); and the two failures a provider reports to the
dispatcher (`RetryableFailure`: try elsewhere; `ProviderExhausted`: move down the chain).

Types only: no I/O, no decisions.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import aiohttp
from aiohttp import web

from gateway.config.gateway_config import ModelConfig
from gateway.routing.endpoints import Endpoint
from gateway.server.client_stream import ClientStream, StreamUsage
from gateway.upstream.mid_stream_resume import Stitcher
from gateway.upstream.so_far import SoFar
from policies.base import Policy, RequestFacts

EMBEDDINGS_PATH = "/v1/embeddings"      # a prompt's vectors: no output tokens, never streamed


def num_sequences(body: Mapping[str, Any]) -> int:
    """The sequences a request samples upstream: `n` choices of each prompt of a batch (a validated body)."""
    prompt = body.get("prompt")
    num_prompts = len(prompt) if isinstance(prompt, list) and len(prompt) > 1 and \
        not all(isinstance(t, int) for t in prompt) else 1
    return (body.get("n") or 1) * num_prompts


def asks_token_ids(body: Mapping[str, Any]) -> bool:
    """The client asked for our workers' token ids itself (so they are not stripped from its answer)."""
    return body.get("return_token_ids") is True


# Built for every request: NamedTuples, immutable and cheaper to build than frozen dataclasses (policies/base.py).
class RoutedRequest(NamedTuple):
    model: ModelConfig                  # the client's model, resolved from config
    api_path: str                       # "/v1/chat/completions", "/v1/completions" or "/v1/embeddings"
    body: Mapping[str, Any]             # the parsed client body
    raw: bytes                          # the client body as received (forwarded when unchanged)
    stream: bool                        # the client asked for SSE
    facts: RequestFacts                 # what the policy sees
    request_id: str                     # x-request-id, forwarded upstream
    started_s: float                    # time.perf_counter() when the request arrived (for TTFT)
    session_id: str | None              # the state store's key for the x-session-affinity session


@dataclass(slots=True)
class Progress:
    """How serving one request goes, across retries and providers (mutable, private to one dispatch)."""
    request: RoutedRequest                                    # what is being served
    client: ClientStream | None                               # the SSE client (None: a non-streaming request)
    policy: Policy                                            # the model's routing policy
    tried: set[str] = field(default_factory=set)              # endpoints that failed (or served) this request
    log: list[str] = field(default_factory=list)              # what was tried and why it failed
    retry_after_s: float | None = None                        # the last upstream Retry-After
    num_failures: int = 0                                     # failed legs
    num_rate_limited: int = 0                                 # of them, those answered 429
    can_fail_over: bool = False                               # a broken stream may be continued elsewhere
    so_far: SoFar | None = None                               # what the client has of a broken stream
    stitch: Stitcher | None = None                            # rewrites the continuation leg's chunks

    @property
    def client_has_data(self) -> bool:
        """Part of an answer reached the client and none of it is being continued: nothing can be retried
        or handed on any more."""
        return self.client is not None and self.client.data_started and self.so_far is None


class LegKind(str, Enum):
    SINGLE = "single"        # the whole request in one leg
    PREFILL = "prefill"      # disaggregated leg 1: the prompt's KV and the first token
    DECODE = "decode"        # disaggregated leg 2: the rest of the output, from the transferred KV


@dataclass(frozen=True, slots=True)
class Wire:
    """How a provider's upstream calls go out (built once per provider)."""
    provider_name: str                  # for metrics and the failure log
    headers: Mapping[str, str]          # Content-Type and the provider's Authorization
    timeout: aiohttp.ClientTimeout      # connect and whole-leg limits (first byte: `first_byte_s`)
    first_byte_s: float                 # request sent -> first body byte


class Leg(NamedTuple):
    wire: Wire                          # the provider's way of calling upstream
    endpoint: Endpoint                  # where the leg goes
    kind: LegKind                       # for metrics
    path: str                           # API path appended to the endpoint's URL
    body: bytes                         # the encoded upstream body
    headers: Mapping[str, str]          # the wire's headers plus x-request-id and traceparent
    num_prompt_tokens: int              # the lease's prefill tokens
    num_output_tokens: int              # the lease's decode tokens


@dataclass(slots=True)
class Outcome:
    response: web.StreamResponse        # what the handler returns
    endpoint_id: str | None             # where it was served (None: an error was relayed or sent)
    usage: StreamUsage                  # tokens, as counted or reported


class ProviderExhausted(Exception):
    """The provider has nothing (left) to try for this request: the dispatcher moves to the next one.
    `unsupported`: the request itself is outside what the provider serves (n > 1 where it is disaggregated, a
    completions request to a Messages API), naming the field where one is to blame ("" where none is); when
    every provider of the chain says so, the client gets a 400, not a 503."""

    def __init__(self, description: str, unsupported: str | None = None) -> None:
        super().__init__(description)
        self.description = description
        self.unsupported = unsupported


class RetryableFailure(Exception):
    """An upstream leg failed before any byte reached the client: another endpoint may be tried."""

    def __init__(self, description: str, *, retry_after_s: float | None = None, rate_limited: bool = False) -> None:
        super().__init__(description)
        self.description = description
        self.retry_after_s = retry_after_s
        self.rate_limited = rate_limited    # the upstream answered 429
