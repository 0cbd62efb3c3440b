"""The response cache: an answer served again to an identical request, without an upstream.

Off unless `response_cache.ttl_s` (or a model's `response_cache_ttl_s`, which overrides it) is set. A request
is identical when its route, model and body are, key order aside and the fields that do not change the answer
left out (`user`, `metadata`, `store`, and `stream_options` unless it streams); and, unless
`shared_across_keys`, its API key (a hit answers faster, which would tell one tenant what another asked). A
streamed request and a whole one are never the same: a stream is kept as the SSE bytes its client got (OpenAI's
events, before another API surface re-encodes them) and replayed as one write. Only what is deterministic is
cached unless `cache_sampled`: `temperature: 0`, or a `seed`; embeddings always (nothing is sampled). Only whole
answers are kept: a 200 of UTF-8 JSON, or a stream that reached its `data: [DONE]` without an error event; at
most `max_entry_bytes`, for the TTL, in the state store (Redis, shared by every replica, or in-process, bounded
by `max_memory_bytes`).

Per request, `x-switchyard-cache: skip` neither reads nor writes, `x-switchyard-cache: refresh` skips the read
and writes the fresh answer, and `x-switchyard-cache-ttl: S` keeps it S seconds (0: not at all). The answer
says `x-switchyard-cache: hit`, `miss` or `bypass` (not cacheable: sampled, skipped).
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.config.gateway_config import ModelConfig, ResponseCacheConfig
from gateway.errors import BadRequest
from gateway.state import StateStore

CACHE_HEADER = "x-switchyard-cache"          # request: skip | refresh; answer: hit | miss | bypass
TTL_HEADER = "x-switchyard-cache-ttl"
MAX_TTL_S = 7 * 24 * 3600.0
_REPEATABLE_ROUTES = frozenset({"/v1/embeddings"})
_IGNORED_FIELDS = frozenset({"stream", "stream_options", "user", "metadata", "store"})   # (a stream: see plan)


class ResponseCache:
    def __init__(self, config: ResponseCacheConfig, store: StateStore) -> None:
        self._config = config
        self._store = store

    def enabled_for(self, model: ModelConfig) -> bool:
        """The model's answers are cached: its `response_cache_ttl_s`, else the global `ttl_s`, is set."""
        return self._model_ttl_s(model) > 0

    def plan(self, headers: Mapping[str, str], route: str, model: ModelConfig, body: Mapping[str, Any],
             key_id: str | None) -> CachePlan:
        """What to do for this request: its key, whether to read, how long to keep its answer."""
        asked = headers.get(CACHE_HEADER, "").strip().lower()
        if asked not in ("", "skip", "refresh"):
            raise BadRequest(f"{CACHE_HEADER} must be 'skip' or 'refresh'", param=CACHE_HEADER)
        ttl_s = self._ttl_s(headers.get(TTL_HEADER), model)
        if asked == "skip" or ttl_s <= 0 or not (route in _REPEATABLE_ROUTES or self._deterministic(body)):
            return CachePlan(None, False, 0.0)
        fields = {k: v for k, v in body.items() if k not in _IGNORED_FIELDS}
        if body.get("stream") is True:     # its events, and what stream_options adds to them
            fields["stream"] = True
            fields["stream_options"] = body.get("stream_options")
        scope = "" if self._config.shared_across_keys or key_id is None else key_id
        try:
            canonical = orjson.dumps([route, model.name, scope, fields], option=orjson.OPT_SORT_KEYS)
        except TypeError:     # a body orjson cannot write back (it parsed it, so not expected): no caching
            return CachePlan(None, False, 0.0)
        return CachePlan(hashlib.sha256(canonical).hexdigest(), asked != "refresh", ttl_s)

    async def read(self, plan: CachePlan) -> bytes | None:
        if plan.key is None or not plan.read:
            return None
        return await self._store.get_response(plan.key)

    @property
    def max_entry_bytes(self) -> int:
        return self._config.max_entry_bytes

    async def keep(self, plan: CachePlan, status: int, body: Any) -> None:
        """Keep a 200's UTF-8 body (JSON, or a whole stream's SSE) within the size limit; nothing else."""
        if plan.key is None or status != 200 or not isinstance(body, bytes):
            return
        if len(body) > self._config.max_entry_bytes:
            return
        try:
            body.decode()
        except UnicodeDecodeError:
            return
        await self._store.put_response(plan.key, body, plan.ttl_s)

    def _model_ttl_s(self, model: ModelConfig) -> float:
        return self._config.ttl_s if model.response_cache_ttl_s is None else model.response_cache_ttl_s

    def _ttl_s(self, raw: str | None, model: ModelConfig) -> float:
        default_s = self._model_ttl_s(model)
        if default_s <= 0:
            return 0.0
        if raw is None:
            return default_s
        try:
            ttl_s = float(raw)
        except ValueError:
            ttl_s = -1.0
        if not 0 <= ttl_s <= MAX_TTL_S:
            raise BadRequest(f"{TTL_HEADER} must be seconds in [0, {MAX_TTL_S:.0f}]", param=TTL_HEADER)
        return ttl_s

    def _deterministic(self, body: Mapping[str, Any]) -> bool:
        temperature = body.get("temperature")
        return self._config.cache_sampled or temperature == 0 or body.get("seed") is not None


@dataclass(frozen=True, slots=True)
class CachePlan:
    key: str | None     # None: not cacheable (the answer says `bypass`)
    read: bool          # False: `refresh`: the answer is fetched and kept anyway
    ttl_s: float

    @property
    def header(self) -> str:
        return "bypass" if self.key is None else "miss"
