"""Disaggregated legs on a worker (docs/disaggregation.md): the prefill leg that holds the prompt's KV
and answers `kv_transfer_params`, the decode leg that pulls that KV and continues, the KV transfer
listener's lifetime, and the debug-only KV digest route. Parsing of OpenAI bodies stays in protocol.py.
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from backends.core.kv_transfer_params import KVTransferParams, RemoteBlocks
from backends.core.outputs import FinishReason
from backends.kv_connectors.pd_connector import PDConnector
from backends.kv_transfer.auth import key_from_text
from backends.kv_transfer.base import KVErrorCode, KVTransferConfig, KVTransport, prefill_kv_transfer_params
from backends.server.app_keys import ENGINE_KEY, METRICS_KEY, TOKENIZER_KEY
from backends.server.errors import APIError, ErrorType, invalid_param
from backends.server.fields import read_json
from backends.server.generation import GenerationDelta, SequenceSpec, generate_deltas
from backends.server.protocol import GenerateRequest, RequestKind, resolve_max_tokens
from backends.server.responses import ResponseBuilder
from backends.server.server_config import ServerConfig, WorkerRole

log = logging.getLogger(__name__)

KV_TRANSFER_FAILED = "kv_transfer_failed"       # 503: pull broke, timed out, or unknown/expired transfer id
KV_TRANSFER_MISMATCH = "kv_transfer_mismatch"   # 400: prompt length or KV layout differs between workers
_MISMATCH_CODES = (KVErrorCode.LAYOUT_MISMATCH, KVErrorCode.BAD_REQUEST)

PD_CONNECTOR_KEY = web.AppKey("pd_connector", PDConnector)


@dataclass(frozen=True, slots=True)
class KVTransferState:
    transport: KVTransport                  # pulls (decode legs) and, for prefill/both, the listener
    engine_id: str                          # stable id of this worker process (remote_engine_id)
    address: tuple[str, int] | None         # advertised listener (host, port); None: decode role


KV_STATE_KEY = web.AppKey("kv_transfer", KVTransferState)


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    remote: RemoteBlocks                # where the held KV is
    num_prompt_tokens: int              # tokens whose KV is held (must equal our tokenization)
    first_token_ids: tuple[int, ...]    # sampled by the prefill worker
    response_id: str | None             # the id the client sees (the prefill response's)


# --- the listener ---------------------------------------------------------------------------------

def kv_transfer_ctx(config: ServerConfig) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        engine, connector = app[ENGINE_KEY], app.get(PD_CONNECTOR_KEY)
        if connector is None:   # the engine has no P/D connector: no listener, and legs are refused (_state)
            yield
            return
        from backends.kv_transfer.tcp import TcpTransport
        from backends.kv_transfer.torch_cache import TorchPagedKV
        from backends.worker.kv_adapter import EngineKVSource, block_digests

        kv = TorchPagedKV(engine.kv_layers(), region=engine.kv_region(), weights=engine.weights_fingerprint())
        transport = TcpTransport(KVTransferConfig(idle_timeout_s=config.kv_idle_timeout_s,
                                                  shared_memory=config.kv_shared_memory,
                                                  key=key_from_text(config.kv_key)),
                                 on_refused=app[METRICS_KEY].observe_kv_refused)
        digest = partial(block_digests, engine.kv_layers()) if config.debug_endpoints else None
        connector.attach(transport, kv, engine.wake, digest)
        address = None
        if config.role is not WorkerRole.DECODE:
            host, port = await transport.serve(EngineKVSource(kv, connector), config.kv_host, config.kv_port)
            address = (config.kv_advertise_host or _advertised(host), port)
            log.info("KV transfer listener on %s:%d (holds expire after %.1f s)", host, port, connector.hold_timeout_s)
        app[KV_STATE_KEY] = KVTransferState(transport, f"{config.role.value}-{uuid.uuid4().hex[:12]}", address)
        try:
            yield
        finally:
            await connector.detach()
            await transport.close()

    return ctx


def _advertised(host: str) -> str:
    return socket.gethostbyname(socket.gethostname()) if host in ("", "0.0.0.0", "::") else host


def _state(app: web.Application) -> KVTransferState:
    state = app.get(KV_STATE_KEY)
    if state is None:
        raise invalid_param("kv_transfer_params", "This worker does not serve disaggregated legs.")
    return state


# --- leg 1: prefill -------------------------------------------------------------------------------

async def prefill_leg(request: web.Request, kind: RequestKind, req: GenerateRequest, prompt_ids: tuple[int, ...],
                      request_id: str, arrival_s: float) -> web.Response:
    """Run the prompt and sample one token; hold the prompt's blocks unless that token finished it."""
    app = request.app
    state = _state(app)
    if state.address is None:
        raise invalid_param("kv_transfer_params", "A decode-role worker does not serve prefill legs.")
    if req.stream:
        raise invalid_param("stream", "A prefill leg (do_remote_decode) must not stream.")
    engine, tokenizer, metrics = app[ENGINE_KEY], app[TOKENIZER_KEY], app[METRICS_KEY]
    one = dataclasses.replace(req, max_tokens=1, params=dataclasses.replace(
        req.params, min_tokens=min(req.params.min_tokens, 1)))
    params = resolve_max_tokens(one, len(prompt_ids), engine.max_model_len)
    spec = SequenceSpec(request_id, prompt_ids, params, req.skip_special_tokens, arrival_s, continues_elsewhere=True,
                        kv_transfer=KVTransferParams(do_remote_decode=True))
    builder = ResponseBuilder(kind, request_id, req.model, tokenizer, return_token_ids=req.return_token_ids)
    async with aclosing(generate_deltas(engine, tokenizer.backend, spec, metrics)) as deltas:
        collected = [delta async for delta in deltas]
    body = builder.final(collected)
    body["kv_transfer_params"] = _held_params(state, app[PD_CONNECTOR_KEY], request_id, collected)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _held_params(state: KVTransferState, connector: PDConnector, request_id: str,
                 collected: list[GenerationDelta]) -> dict[str, Any] | None:
    hold = connector.hold(request_id)
    if hold is None:
        return None
    if not collected or collected[-1].finish_reason is not FinishReason.LENGTH:
        connector.release_transfer(request_id)   # a stop string ended it: no decode leg will come
        return None
    assert state.address is not None
    params = prefill_kv_transfer_params(state.engine_id, *state.address, request_id, hold.block_ids)
    params.update(num_prompt_tokens=hold.num_tokens, first_token_ids=[t for d in collected for t in d.token_ids],
                  num_cached_tokens=collected[-1].num_cached_tokens)
    return params


# --- leg 2: decode --------------------------------------------------------------------------------

def decode_leg(app: web.Application, kind: RequestKind, req: GenerateRequest, prompt_ids: tuple[int, ...],
               params_in: Mapping[str, Any], request_id: str, arrival_s: float) -> tuple[SequenceSpec, ResponseBuilder]:
    """What the ordinary response path runs for a decode leg: a spec whose context ends with the first
    token(s) and whose KV the engine's connector pulls, and a builder that counts them in usage."""
    _state(app)
    engine, tokenizer = app[ENGINE_KEY], app[TOKENIZER_KEY]
    try:
        leg = parse_decode_leg(params_in, len(prompt_ids), engine.block_size,
                               min(tokenizer.vocab_size, engine.vocab_size))
        params = resolve_max_tokens(req, len(prompt_ids), engine.max_model_len)
        if len(leg.first_token_ids) >= params.max_tokens:
            raise invalid_param("max_tokens", "max_tokens leaves nothing to decode after the first token.")
    except APIError:   # e.g. min_tokens above max_tokens, or no room in the context: the prefill leg, run
        remote = _remote_or_none(params_in)   # with max_tokens 1, could not tell; its hold is of no use now
        if remote is not None:
            app[PD_CONNECTOR_KEY].release_refused(remote)
        raise
    spec = SequenceSpec(request_id, prompt_ids + leg.first_token_ids, params, req.skip_special_tokens, arrival_s,
                        num_prior_output_tokens=len(leg.first_token_ids),
                        kv_transfer=KVTransferParams(remote=leg.remote, first_token_ids=leg.first_token_ids))
    builder = ResponseBuilder(kind, leg.response_id or request_id, req.model, tokenizer,
                              return_token_ids=req.return_token_ids,
                              prior_completion_ids=leg.first_token_ids)
    return spec, builder


@contextmanager
def kv_load_errors(app: web.Application, request_id: str) -> Iterator[None]:
    """A decode leg whose pull failed: the engine's error becomes kv_transfer_failed (503) or
    kv_transfer_mismatch (400), the codes the gateway acts on."""
    try:
        yield
    except APIError:
        connector = app.get(PD_CONNECTOR_KEY)
        exc = None if connector is None else connector.take_load_error(request_id)
        if exc is None:
            raise
        if exc.code in _MISMATCH_CODES:
            raise APIError(f"KV transfer refused: {exc}", param="kv_transfer_params",
                           code=KV_TRANSFER_MISMATCH) from None
        raise APIError(f"KV transfer failed: {exc}", status=HTTPStatus.SERVICE_UNAVAILABLE,
                       error_type=ErrorType.UNAVAILABLE, code=KV_TRANSFER_FAILED) from None


def _remote_or_none(params: Mapping[str, Any]) -> RemoteBlocks | None:
    try:
        return RemoteBlocks.from_params(params)
    except ValueError:
        return None


def parse_decode_leg(params: Mapping[str, Any], num_prompt_tokens: int, block_size: int, vocab_size: int) -> DecodeLeg:
    try:
        remote = RemoteBlocks.from_params(params)
    except ValueError as exc:
        raise invalid_param(f"kv_transfer_params.{str(exc).split()[0]}", str(exc)) from None
    held = params.get("num_prompt_tokens")
    if type(held) is not int:
        raise invalid_param("kv_transfer_params.num_prompt_tokens", "num_prompt_tokens must be an integer.")
    if held != num_prompt_tokens or (remote.num_blocks is not None and remote.num_blocks != -(-held // block_size)):
        raise APIError(f"The prefill worker held {held} prompt tokens in {remote.num_blocks} blocks; this worker "
                       f"tokenized {num_prompt_tokens} tokens into blocks of {block_size}.",
                       param="kv_transfer_params.num_prompt_tokens", code=KV_TRANSFER_MISMATCH)
    first = params.get("first_token_ids")
    if not isinstance(first, list) or not first or not all(type(t) is int and 0 <= t < vocab_size for t in first):
        raise invalid_param("kv_transfer_params.first_token_ids",
                            f"first_token_ids must be a non-empty array of token ids in [0, {vocab_size}).")
    response_id = params.get("response_id")
    if response_id is not None and (not isinstance(response_id, str) or not response_id):
        raise invalid_param("kv_transfer_params.response_id", "response_id must be a non-empty string.")
    return DecodeLeg(remote, held, tuple(first), response_id)


async def release_hold(request: web.Request) -> web.Response:
    """POST /kv_holds/release {"transfer_id": X}: the caller (the gateway) will send no decode leg for that hold
    (it fell back to another provider, redid the prefill, or its client went away), so its blocks are freed now,
    not when the hold expires. `released` is false for a transfer this worker does not hold (any more)."""
    state = _state(request.app)
    if state.address is None:
        raise invalid_param("transfer_id", "A decode-role worker holds no KV for others.")
    body = await read_json(request)
    transfer_id = body.get("transfer_id") if isinstance(body, dict) else None
    if not isinstance(transfer_id, str) or not transfer_id:
        raise invalid_param("transfer_id", "`transfer_id` must be a non-empty string.")
    released = request.app[PD_CONNECTOR_KEY].release_transfer(transfer_id)
    return web.Response(body=orjson.dumps({"released": released}), content_type="application/json")


# --- debug ----------------------------------------------------------------------------------------

async def kv_digest(request: web.Request) -> web.Response:
    """GET /debug/kv_digest?transfer_id=X: digests of the blocks held (prefill) or received (decode)."""
    _state(request.app)
    transfer_id = request.query.get("transfer_id", "")
    connector = request.app[PD_CONNECTOR_KEY]
    from backends.worker.kv_adapter import block_digests

    held = connector.lookup(transfer_id)
    body = {"held": None if held is None else block_digests(request.app[ENGINE_KEY].kv_layers(), held),
            "received": connector.received.get(transfer_id), "totals": connector.totals}
    return web.Response(body=orjson.dumps(body), content_type="application/json")
