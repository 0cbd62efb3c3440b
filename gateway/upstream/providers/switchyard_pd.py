"""The `switchyard-pd` provider kind: disaggregated serving as in docs/disaggregation.md. An attempt is a
prefill leg on the prefill pool (`prefill_endpoints`), then a decode leg on the decode pool (`endpoints`)
that carries the prefill's `kv_transfer_params`. Each pool has its own leases. The prefill worker is where a
prompt's prefix cache lives, so the model's policy picks it, as it picks a unified endpoint, and a session is
pinned to it (a model whose config names no policy keeps the pool's default); the decode pool has its own policy.
What the two legs say about the KV is the pools' `KvHandshake` (vLLM's connectors: providers/vllm_pd.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import aiohttp
import orjson
from opentelemetry.trace import SpanKind

from gateway.config.gateway_config import ConfigError, Pool, ProviderConfig
from gateway.routing.endpoints import Endpoint
from gateway.routing.load import Lease
from gateway.server.client_stream import DONE_EVENT, ClientGone, StreamUsage, error_event
from gateway.upstream.legs import MAX_ERROR_BODY, Chosen, Legs, error_code, error_message, leg_body
from gateway.upstream.mid_stream_resume import Stitcher, StreamBroken, Transcript, without_token_ids
from gateway.upstream.providers.base import ProviderRun
from gateway.upstream.providers.openai import openai_wire
from gateway.upstream.providers.pd_answer import (
    PrefillResult,
    cached_tokens,
    chunk_base,
    decoded_whole,
    joined,
    json_response,
    sse_chunk,
    stream_usage,
    usage_body,
)
from gateway.upstream.providers.pd_handshake import KvHandshake, SwitchyardHandshake
from gateway.upstream.providers.pd_pairs import PdPairs
from gateway.upstream.request import (
    EMBEDDINGS_PATH,
    Leg,
    LegKind,
    Outcome,
    Progress,
    ProviderExhausted,
    RetryableFailure,
    Wire,
    asks_token_ids,
    num_sequences,
)
from policies.base import Decision
from policies.registry import PolicyName, make_policy

log = logging.getLogger(__name__)

_KV_TRANSFER_FAILED = "kv_transfer_failed"      # 503: the pull broke or the transfer id expired
_KV_TRANSFER_MISMATCH = "kv_transfer_mismatch"  # 400: the pools disagree on the prompt or KV layout
_MIN_KV_FREE_FRACTION = 0.05                    # decode workers below this free KV are used only if all are


class KvTransferFailed(Exception):
    """The decode worker could not get the held KV (`kv_transfer_failed` / `kv_transfer_mismatch`)."""

    def __init__(self, code: str, message: str, endpoint: Endpoint) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.endpoint = endpoint         # the decode worker


class SwitchyardPdProvider:
    def __init__(self, config: ProviderConfig, handshake: KvHandshake | None = None) -> None:
        if not config.prefill_endpoints:
            raise ConfigError(f"providers.{config.name}.prefill_endpoints: required for kind {config.kind.value}")
        self.config = config
        self.wire = openai_wire(config)
        self.handshake = handshake or SwitchyardHandshake()
        # Prefill, for a model whose config names no policy: least queued prompt tokens, after prefix hits where
        # the pool reports its KV events (ours over HTTP, vLLM's over ZMQ).
        prefill_costs = {"prefill_weight": 1.0, "decode_weight": 0.0}
        prefix_aware = config.offers_kv_events or bool(config.kv_event_sources)
        self.prefill_policy = make_policy(PolicyName.PREFIX_AWARE if prefix_aware else PolicyName.LEAST_TOKENS,
                                          prefill_costs)
        # Decode: least output tokens in flight, among the workers with KV headroom.
        self.decode_policy = make_policy(PolicyName.LEAST_TOKENS, {
            "prefill_weight": 0.0, "decode_weight": 1.0, "min_kv_free_fraction": _MIN_KV_FREE_FRACTION})
        self.pairs = PdPairs()          # which decode workers refuse which prefill worker's KV

    def start(self, progress: Progress, legs: Legs) -> ProviderRun:
        return _PdRun(self, progress, legs)


class _PdRun:
    """One request on one disaggregated provider. A prefill whose KV is held survives a failed decode
    leg, so that the retry only redoes the decode."""

    __slots__ = ("_config", "_held", "_legs", "_progress", "_provider")

    def __init__(self, provider: SwitchyardPdProvider, progress: Progress, legs: Legs) -> None:
        self._provider = provider
        self._config = provider.config
        self._progress = progress
        self._legs = legs
        self._held: PrefillResult | None = None   # the prefill whose KV a decode leg may still claim

    async def __call__(self) -> Outcome:
        try:
            return await self._attempt()
        except (asyncio.CancelledError, ClientGone):
            self.abandon()   # the client left: no decode leg will claim what the prefill holds
            raise

    async def _attempt(self) -> Outcome:
        """Prefill (unless a held prefill survives from a failed decode leg), then decode."""
        progress, legs, provider = self._progress, self._legs, self._provider
        body = progress.request.body
        if progress.num_failures:
            legs.metrics.on_retry(progress.request.facts.model)
        if progress.so_far is not None or num_sequences(body) != 1 or _forces_tool_calls(body) \
                or progress.request.api_path == EMBEDDINGS_PATH:
            return await self._whole_on_decode()
        decode_pool = legs.pool(self._config.name, Pool.MAIN)
        held = self._held
        if held is None:
            if not legs.has_candidate(progress, decode_pool):
                raise self._fall_back("decode_pool_unavailable")
            prefilled = await self._prefill(await self._choose_prefill())
            if isinstance(prefilled, Outcome):
                return prefilled  # the prefill worker rejected the request (a 4xx, relayed)
            held = prefilled
            if held.kv_transfer_params is None or held.finish_reason == "stop" or _max_tokens(body) == 1:
                return await self._answer_prefill_only(held)
            self._held = held
            if progress.client is not None and not provider.handshake.decode_answers_whole:
                first = sse_chunk(progress, held, {"role": "assistant", "content": held.text}, None)
                await progress.client.send_first(first if asks_token_ids(body) else without_token_ids(first),
                                                 "text/event-stream")
                legs.metrics.observe_ttft(progress.request.facts.model,
                                          time.perf_counter() - progress.request.started_s)
        chosen = legs.choose(progress, self._takers(held, decode_pool), provider.decode_policy)
        if chosen is None:
            raise self._fall_back("decode_pool_exhausted")
        try:
            return await self._decode(held, chosen.endpoint, chosen.decision)
        except KvTransferFailed as exc:
            return await self._redo(exc)

    async def _choose_prefill(self) -> Chosen:
        """The prefill worker: the model's policy picks it where the model's config names one (`session_affinity`
        keeps a session where its prefix is cached, within the load bound), else the pool's default; the session
        is pinned to it before the leg starts, as a unified leg's is (`Legs.pin_session`)."""
        progress, legs = self._progress, self._legs
        policy = progress.policy if progress.request.model.policy.named else self._provider.prefill_policy
        chosen = legs.choose(progress, legs.pool(self._config.name, Pool.PREFILL), policy)
        if chosen is None:
            raise self._fall_back("prefill_pool_unavailable")
        await legs.pin_session(progress, chosen.decision)
        return chosen

    def _takers(self, held: PrefillResult, decode_pool: list[Endpoint]) -> list[Endpoint]:
        """The decode workers not known to refuse the prefill worker's KV (`PdPairs`: by the weights their
        `/load` reports or by a refusal); the whole pool when none of them could take the leg."""
        prefill = self._prefill_endpoint(held)
        if prefill is None:
            return decode_pool
        takers = self._provider.pairs.takers(prefill, decode_pool, time.monotonic())
        return takers if len(takers) < len(decode_pool) and self._legs.has_candidate(self._progress, takers) \
            else decode_pool

    def _prefill_endpoint(self, held: PrefillResult) -> Endpoint | None:
        return next((e for e in self._legs.pool(self._config.name, Pool.PREFILL) if e.endpoint_id == held.endpoint_id),
                    None)

    async def _whole_on_decode(self) -> Outcome:
        """One leg on a decode worker, which computes the KV itself (a decode worker serves whole requests too):
        a stream broken mid-way (here or elsewhere) goes on from the output so far (`progress.so_far`); a request
        whose held KV other weights computed starts there afresh; n > 1 or a batch of prompts (a prefill leg
        samples one sequence); a forced tool call (the worker answers its text as calls, whole); embeddings (a
        prompt's vectors, with nothing to decode)."""
        progress, legs, request = self._progress, self._legs, self._progress.request
        built = leg_body(self._config, request.body, request.raw, can_fail_over=progress.can_fail_over,
                         so_far=progress.so_far)
        if built is None:
            raise ProviderExhausted("cannot continue this answer from text")
        if progress.so_far is not None:
            progress.stitch = Stitcher(progress.so_far, request.api_path.endswith("chat/completions"), built[1],
                                      request.body)
        chosen = legs.choose(progress, legs.pool(self._config.name, Pool.MAIN), self._provider.decode_policy)
        if chosen is None:
            raise self._fall_back("decode_pool_exhausted")
        endpoint, decision, prefill_work = chosen
        progress.tried.add(endpoint.endpoint_id)
        legs.metrics.on_decision(request.facts.model, decision.reason.value)
        with legs.tracing.span("upstream_attempt", SpanKind.CLIENT) as span:
            headers = legs.leg_headers(progress, span, self.wire, endpoint.endpoint_id, decision)
            leg = Leg(self.wire, endpoint, LegKind.SINGLE, request.api_path, built[0], headers,
                      prefill_work, request.facts.num_expected_output_tokens)
            return await legs.send(progress, leg, partial(legs.relay, progress, endpoint))

    def abandon(self) -> None:
        """No decode leg will claim the held prefill (another provider serves, the client left, retries ran out)."""
        held, self._held = self._held, None
        if held is not None:
            self._release(held)

    def _release(self, held: PrefillResult) -> None:
        """Ask the prefill worker to free the blocks it holds for `held` now, not when the hold expires."""
        transfer_id = (held.kv_transfer_params or {}).get("remote_request_id")
        if isinstance(transfer_id, str) and transfer_id:
            self._legs.notify(self.wire, f"{held.endpoint_id}/kv_holds/release", {"transfer_id": transfer_id})

    @property
    def wire(self) -> Wire:
        return self._provider.wire

    def _fall_back(self, cause: str) -> ProviderExhausted:
        """The error that hands the request to the next provider (the dispatcher cannot once the client
        has a token)."""
        self.abandon()
        if not self._progress.client_has_data:
            self._legs.metrics.on_pd_fallback(self._progress.request.facts.model, self._config.name, cause)
        return ProviderExhausted(cause.replace("_", " "))

    async def _redo(self, exc: KvTransferFailed) -> Outcome:
        """The held KV did not reach the decode worker. Once the client has the first token, the stream goes on
        from it on a decode worker (the dispatcher's mid-stream failover; where the model allows none, an error
        event ends it). Before that: KV of other weights (`kv_transfer_mismatch`: the pools hold two revisions,
        as in a rolling upgrade) is not asked for again, the request runs whole on a decode worker; a transfer
        that failed is redone from a new prefill."""
        progress, name = self._progress, self._config.name
        held, self._held = self._held, None
        assert held is not None
        if exc.code == _KV_TRANSFER_FAILED:   # a pull that broke leaves the hold (a mismatch's is released)
            self._release(held)
        self._legs.metrics.on_pd_redo(progress.request.facts.model, exc.code)
        prefill = self._prefill_endpoint(held)
        if exc.code == _KV_TRANSFER_MISMATCH and prefill is not None \
                and self._provider.pairs.refuse(prefill, exc.endpoint, time.monotonic()):
            log.warning("provider %s: decode worker %s refuses the KV of prefill worker %s, which its next decode legs "
                        "avoid (two revisions of the model, as in a rolling upgrade?): %s",
                        name, exc.endpoint.endpoint_id, prefill.endpoint_id, exc)
        client = progress.client
        if client is not None and client.data_started:
            if progress.can_fail_over:
                sent = Transcript(sse_chunk(progress, held, {"role": "assistant", "content": held.text}, None))
                raise StreamBroken(held.endpoint_id, exc.code, sent, StreamUsage())
            await client.fail(error_event(f"disaggregated decode failed: {exc}", code=exc.code))
            return Outcome(await client.finish(), None, StreamUsage())
        if exc.code == _KV_TRANSFER_MISMATCH:
            return await self._whole_on_decode()
        failure = RetryableFailure(str(exc))
        self._legs.record_failure(progress, name, None, failure)
        raise failure

    # --- leg 1: prefill ----------------------------------------------------------------------------

    async def _prefill(self, chosen: Chosen) -> PrefillResult | Outcome:
        progress, legs, wire = self._progress, self._legs, self._provider.wire
        endpoint, decision, prefill_work = chosen
        request = progress.request
        body = {k: v for k, v in request.body.items() if k not in ("max_completion_tokens", "stream_options")}
        body.update(max_tokens=1, stream=False)
        sent: dict[str, Any] = {}
        if _max_tokens(request.body) != 1:   # else the one token is the answer: nothing to hold
            body["kv_transfer_params"] = sent = self._provider.handshake.prefill_params()
        if self._asks_token_ids():
            body["return_token_ids"] = True
        if self._config.upstream_model is not None:
            body["model"] = self._config.upstream_model
        legs.metrics.on_decision(request.facts.model, decision.reason.value)
        with legs.tracing.span("prefill_leg", SpanKind.CLIENT) as span:
            headers = legs.leg_headers(progress, span, wire, endpoint.endpoint_id, decision)
            leg = Leg(wire, endpoint, LegKind.PREFILL, request.api_path, orjson.dumps(body), headers,
                      prefill_work, 0)
            return await legs.send(progress, leg, partial(self._read_prefill, endpoint, sent))

    async def _read_prefill(self, endpoint: Endpoint, sent: Mapping[str, Any], response: aiohttp.ClientResponse,
                            first_byte_deadline: Any, lease: Lease) -> PrefillResult | Outcome:
        if response.status != 200:
            return await self._legs.non_200(response, endpoint.breaker, self._progress.client)
        payload = orjson.loads(await response.read())
        try:
            choice = payload["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            returned = payload.pop("kv_transfer_params", None)
            params = self._provider.handshake.decode_params(
                endpoint.endpoint_id, sent, returned if isinstance(returned, dict) else None) if sent else None
            result = PrefillResult(endpoint.endpoint_id, payload, text or "", choice.get("finish_reason"),
                                   params, payload.get("usage") or {})
        except (KeyError, IndexError, TypeError):
            endpoint.breaker.on_failure()
            raise RetryableFailure("bad prefill answer: no first token") from None
        endpoint.breaker.on_success()
        return result

    async def _answer_prefill_only(self, held: PrefillResult) -> Outcome:
        """The first token ended the request (or max_tokens is 1): no decode leg."""
        progress = self._progress
        usage = usage_body(held.usage, held.usage.get("completion_tokens", 1))
        finish_reason = held.finish_reason or "length"
        if progress.client is None:
            return Outcome(json_response(held.payload), held.endpoint_id, stream_usage(usage))
        client = progress.client
        events = sse_chunk(progress, held, {"role": "assistant", "content": held.text}, None) + \
            sse_chunk(progress, held, {}, finish_reason)
        if (progress.request.body.get("stream_options") or {}).get("include_usage"):
            events += b"data: " + orjson.dumps({**chunk_base(progress, held), "choices": [], "usage": usage}) \
                + b"\n\n"
        await client.send_first(events + DONE_EVENT, "text/event-stream")
        self._legs.metrics.observe_ttft(progress.request.facts.model,
                                        time.perf_counter() - progress.request.started_s)
        return Outcome(await client.finish(), held.endpoint_id, stream_usage(usage))

    # --- leg 2: decode -----------------------------------------------------------------------------

    async def _decode(self, held: PrefillResult, endpoint: Endpoint, decision: Decision) -> Outcome:
        progress, legs, wire = self._progress, self._legs, self._provider.wire
        request = progress.request
        params = {**(held.kv_transfer_params or {}), "response_id": held.payload.get("id")}
        body = {**request.body, "kv_transfer_params": params}
        if self._asks_token_ids():
            body["return_token_ids"] = True
        if self._config.upstream_model is not None:
            body["model"] = self._config.upstream_model
        with legs.tracing.span("decode_leg", SpanKind.CLIENT) as span:
            headers = legs.leg_headers(progress, span, wire, endpoint.endpoint_id, decision)
            leg = Leg(wire, endpoint, LegKind.DECODE, request.api_path, orjson.dumps(body), headers,
                      0, request.facts.num_expected_output_tokens)
            outcome = await legs.send(progress, leg, partial(self._read_decode, held, endpoint))
        if outcome.endpoint_id is not None:  # prompt and cached tokens are the prefill's to report
            outcome.usage.num_prompt_tokens = held.usage.get("prompt_tokens", outcome.usage.num_prompt_tokens)
            outcome.usage.num_cached_tokens = cached_tokens(held.usage)
            if not outcome.usage.exact and not self._provider.handshake.decode_answers_whole:
                outcome.usage.num_output_tokens += 1  # the first token came from the prefill
        return outcome

    async def _read_decode(self, held: PrefillResult, endpoint: Endpoint, response: aiohttp.ClientResponse,
                           first_byte_deadline: Any, lease: Lease) -> Outcome:
        legs, client = self._legs, self._progress.client
        if response.status != 200:
            body = await response.content.read(MAX_ERROR_BODY)
            code = error_code(body)
            if code in (_KV_TRANSFER_FAILED, _KV_TRANSFER_MISMATCH):
                raise KvTransferFailed(code, error_message(body), endpoint)
            return await legs.answer_error(response, body, endpoint.breaker, client)
        whole = self._provider.handshake.decode_answers_whole
        if client is None:
            payload = orjson.loads(await response.read())
            endpoint.breaker.on_success()
            return (decoded_whole if whole else joined)(held, payload, endpoint.endpoint_id)
        first = await legs.first_chunk(response, first_byte_deadline, lease)
        self._held = None   # a token came: the decode worker has the KV (its pull released the hold)
        sent = b"" if whole else sse_chunk(self._progress, held, {"role": "assistant", "content": held.text}, None)
        return await legs.relay_stream(self._progress, response, first, lease, endpoint, sent_before=sent)

    def _asks_token_ids(self) -> bool:
        """Legs ask for token ids when the stream may fail over (they are dropped before the client unless it
        asked for them too)."""
        return self._progress.can_fail_over and self._config.offers_token_ids


def _forces_tool_calls(body: Mapping[str, Any]) -> bool:
    """tool_choice "required" or naming a function, with tools: the worker answers `tool_calls` read from the
    text it decodes, so the answer comes from one worker."""
    choice = body.get("tool_choice")
    return bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    return body.get("max_completion_tokens") or body.get("max_tokens")
