"""Disaggregated legs on a worker (docs/disaggregation.md): the prefill leg that holds the prompt's KV
and answers `kv_transfer_params`, the decode leg that pulls that KV and continues, the KV transfer
listener's lifetime, and the debug-only KV digest route. Parsing of OpenAI bodies stays in protocol.py.
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

import orjson
from aiohttp import web

from backends.engine.outputs import FinishReason, SequenceOutput
from backends.engine.sampling_params import SamplingParams
from backends.kv_transfer.base import (KVConnector, KVErrorCode, KVTransferConfig, KVTransferError,
                                       RemoteBlocks, prefill_kv_transfer_params)
from backends.server.config import ServerConfig, WorkerRole
from backends.server.errors import APIError, ErrorType, invalid_param
from backends.server.generation import GenerationDelta, SequenceSpec, generate_deltas
from backends.server.keys import ENGINE_KEY, METRICS_KEY, TOKENIZER_KEY
from backends.server.protocol import GenerateRequest, RequestKind, resolve_max_tokens
from backends.server.responses import ResponseBuilder

log = logging.getLogger(__name__)

KV_TRANSFER_FAILED = "kv_transfer_failed"       # 503: pull broke, timed out, or unknown/expired transfer id
KV_TRANSFER_MISMATCH = "kv_transfer_mismatch"   # 400: prompt length or KV layout differs between workers
_MAX_DEBUG_RECORDS = 256
_MISMATCH_CODES = (KVErrorCode.LAYOUT_MISMATCH, KVErrorCode.BAD_REQUEST)


class DisaggEngine(Protocol):
    """The part of `DisaggAsyncEngine` the legs use (besides `WorkerEngine`)."""

    block_size: int
    max_model_len: int

    def generate_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                         ) -> AsyncIterator[SequenceOutput]: ...

    def generate_remote(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        first_token_ids: Sequence[int], pull: Callable[[Any], Any]) -> AsyncIterator[SequenceOutput]: ...

    def hold(self, transfer_id: str) -> Any: ...

    def release_transfer(self, transfer_id: str) -> bool: ...

    def lookup(self, transfer_id: str) -> Sequence[int] | None: ...

    def kv_layers(self) -> list[Any]: ...

    def kv_region(self) -> Any: ...

    async def abort(self, request_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class KVTransferState:
    connector: KVConnector                  # pulls (decode legs) and, for prefill/both, the listener
    kv: Any                                 # TorchPagedKV over the engine's cache: the pull's sink
    engine_id: str                          # stable id of this worker process (remote_engine_id)
    address: tuple[str, int] | None         # advertised listener (host, port); None: decode role
    debug: bool                             # record digests of received blocks for /debug/kv_digest
    received: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)  # debug records
    totals: dict[str, float] = field(default_factory=lambda: {"pulls": 0, "bytes": 0, "seconds": 0.0,
                                                              "shared_memory_pulls": 0})


KV_STATE_KEY = web.AppKey("kv_transfer", KVTransferState)


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    remote: RemoteBlocks                # where the held KV is
    num_prompt_tokens: int              # tokens whose KV is held (must equal our tokenization)
    first_token_ids: tuple[int, ...]    # sampled by the prefill worker
    response_id: str | None             # the id the client sees (the prefill response's)


def kv_transfer_params(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise invalid_param("kv_transfer_params", "`kv_transfer_params` must be an object.")
    if params.get("do_remote_decode") is True or params.get("do_remote_prefill") is True:
        return params
    return None   # neither leg asked for (vLLM sends such params on plain requests): serve normally


# --- the listener ---------------------------------------------------------------------------------

def kv_transfer_ctx(config: ServerConfig) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        engine = app[ENGINE_KEY]
        if not hasattr(engine, "kv_layers"):   # an engine without disaggregation: legs get a 400
            yield
            return
        from backends.kv_transfer.tcp import TcpKVConnector
        from backends.kv_transfer.torch_cache import TorchPagedKV
        from backends.worker.kv_adapter import EngineKVSource

        kv = TorchPagedKV(engine.kv_layers(), region=engine.kv_region())
        connector = TcpKVConnector(KVTransferConfig(idle_timeout_s=config.kv_idle_timeout_s,
                                                    shared_memory=config.kv_shared_memory))
        address = None
        if config.role is not WorkerRole.DECODE:
            host, port = await connector.serve(EngineKVSource(kv, engine), config.kv_host, config.kv_port)
            address = (config.kv_advertise_host or _advertised(host), port)
            log.info("KV transfer listener on %s:%d (holds expire after %.1f s)", host, port, config.kv_hold_timeout_s)
        app[KV_STATE_KEY] = KVTransferState(connector, kv, f"{config.role.value}-{uuid.uuid4().hex[:12]}",
                                            address, config.debug_endpoints)
        try:
            yield
        finally:
            await connector.close()

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
    engine: DisaggEngine = app[ENGINE_KEY]  # type: ignore[assignment]
    tokenizer, metrics = app[TOKENIZER_KEY], app[METRICS_KEY]
    one = dataclasses.replace(req, max_tokens=1, params=dataclasses.replace(
        req.params, min_tokens=min(req.params.min_tokens, 1)))
    params = resolve_max_tokens(one, len(prompt_ids), engine.max_model_len)
    spec = SequenceSpec(request_id, prompt_ids, params, req.skip_special_tokens, arrival_s, continues_elsewhere=True)
    builder = ResponseBuilder(kind, request_id, req.model, tokenizer.backend, return_token_ids=req.return_token_ids)
    async with aclosing(generate_deltas(_PrefillEngine(engine), tokenizer.backend, spec, metrics)) as deltas:
        collected = [delta async for delta in deltas]
    body = builder.final(collected)
    body["kv_transfer_params"] = _held_params(state, engine, request_id, collected)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _held_params(state: KVTransferState, engine: DisaggEngine, request_id: str,
                 collected: list[GenerationDelta]) -> dict[str, Any] | None:
    hold = engine.hold(request_id)
    if hold is None:
        return None
    if not collected or collected[-1].finish_reason is not FinishReason.LENGTH:
        engine.release_transfer(request_id)   # a stop string ended it: no decode leg will come
        return None
    assert state.address is not None
    params = prefill_kv_transfer_params(state.engine_id, *state.address, request_id, hold.block_ids)
    params.update(num_prompt_tokens=hold.num_tokens, first_token_ids=[t for d in collected for t in d.token_ids],
                  num_cached_tokens=collected[-1].num_cached_tokens)
    return params


class _PrefillEngine:
    def __init__(self, engine: DisaggEngine) -> None:
        self._engine = engine

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                 ) -> AsyncIterator[SequenceOutput]:
        return self._engine.generate_prefill(request_id, prompt_token_ids, params)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)


# --- leg 2: decode --------------------------------------------------------------------------------

def decode_leg(app: web.Application, kind: RequestKind, req: GenerateRequest, prompt_ids: tuple[int, ...],
               params_in: Mapping[str, Any], request_id: str, arrival_s: float
               ) -> tuple[_DecodeEngine, SequenceSpec, ResponseBuilder]:
    """What the ordinary response path runs for a decode leg: an engine view that pulls the KV first,
    a spec whose context ends with the first token(s), and a builder that counts them in usage."""
    state = _state(app)
    engine: DisaggEngine = app[ENGINE_KEY]  # type: ignore[assignment]
    tokenizer = app[TOKENIZER_KEY]
    leg = parse_decode_leg(params_in, len(prompt_ids), engine.block_size, min(tokenizer.vocab_size, app[ENGINE_KEY].vocab_size))
    params = resolve_max_tokens(req, len(prompt_ids), engine.max_model_len)
    if len(leg.first_token_ids) >= params.max_tokens:
        raise invalid_param("max_tokens", "max_tokens leaves nothing to decode after the first token.")
    spec = SequenceSpec(request_id, prompt_ids + leg.first_token_ids, params, req.skip_special_tokens, arrival_s,
                        num_prior_output_tokens=len(leg.first_token_ids))
    builder = ResponseBuilder(kind, leg.response_id or request_id, req.model, tokenizer.backend,
                              return_token_ids=req.return_token_ids,
                              num_prior_completion_tokens=len(leg.first_token_ids))
    return _DecodeEngine(engine, state, leg), spec, builder


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


class _DecodeEngine:
    """`GeneratingEngine` for a decode leg: admission, pull, release, then the engine's outputs."""

    def __init__(self, engine: DisaggEngine, state: KVTransferState, leg: DecodeLeg) -> None:
        self._engine = engine
        self._state = state
        self._leg = leg

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                 ) -> AsyncIterator[SequenceOutput]:
        k = len(self._leg.first_token_ids)
        return self._engine.generate_remote(request_id, prompt_token_ids[:-k], params, prompt_token_ids[-k:], self._pull)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def _pull(self, admission: Any) -> None:
        state, remote = self._state, self._leg.remote
        start = admission.num_cached_tokens // self._engine.block_size
        local = admission.block_ids[start:]
        try:
            if local:
                result = await state.connector.pull(remote, state.kv, local, start)
                state.totals.update(pulls=state.totals["pulls"] + 1, bytes=state.totals["bytes"] + result.num_bytes,
                                    seconds=state.totals["seconds"] + result.elapsed_s,
                                    shared_memory_pulls=state.totals["shared_memory_pulls"] + result.shared_memory)
            else:   # every prompt block was in our prefix cache: only the release is left
                await state.connector.release(remote)
        except KVTransferError as exc:
            log.warning("KV pull of %s from %s:%d failed: %s", remote.transfer_id, remote.host, remote.port, exc)
            if exc.code in _MISMATCH_CODES:
                raise APIError(f"KV transfer refused: {exc}", param="kv_transfer_params",
                               code=KV_TRANSFER_MISMATCH) from None
            raise APIError(f"KV transfer failed: {exc}", status=HTTPStatus.SERVICE_UNAVAILABLE,
                           error_type=ErrorType.UNAVAILABLE, code=KV_TRANSFER_FAILED) from None
        if state.debug:
            from backends.worker.kv_adapter import block_digests

            state.received[remote.transfer_id] = {"start_block": start,
                                                  "digests": block_digests(self._engine.kv_layers(), local)}
            while len(state.received) > _MAX_DEBUG_RECORDS:
                state.received.popitem(last=False)


# --- debug ----------------------------------------------------------------------------------------

async def kv_digest(request: web.Request) -> web.Response:
    """GET /debug/kv_digest?transfer_id=X: digests of the blocks held (prefill) or received (decode)."""
    state = _state(request.app)
    transfer_id = request.query.get("transfer_id", "")
    engine: DisaggEngine = request.app[ENGINE_KEY]  # type: ignore[assignment]
    from backends.worker.kv_adapter import block_digests

    held = engine.lookup(transfer_id)
    body = {"held": None if held is None else block_digests(engine.kv_layers(), held),
            "received": state.received.get(transfer_id), "totals": state.totals}
    return web.Response(body=orjson.dumps(body), content_type="application/json")
