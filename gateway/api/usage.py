"""GET /v1/usage: per-key token usage, the key's limits and what its daily quota has left. A key reads its own;
an admin key may pass `?key_id=` for any."""
from __future__ import annotations

import dataclasses

import orjson
from aiohttp import web

from gateway.api.admission import DAILY_SUFFIX
from gateway.errors import BadRequest, Forbidden
from gateway.server.middlewares import KEYS, caller_key
from gateway.services import SERVICES


async def get_usage(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    key = caller_key(request)
    if key is None:
        raise BadRequest("usage is tracked per API key and no keys are configured")
    key_id = request.query.get("key_id", key.key_id)
    if key_id != key.key_id and not key.admin:
        raise Forbidden("only an admin key may read another key's usage", param="key_id")
    usage = await services.store.get_usage(key_id)
    body = {"object": "usage", "key_id": key_id, **dataclasses.asdict(usage)}
    auth = request.app[KEYS].auth
    if (subject := auth.by_id(key_id) if auth is not None else None) is not None:
        body["limits"] = {"max_requests_per_min": subject.max_requests_per_min,
                          "max_tokens_per_min": subject.max_tokens_per_min,
                          "max_tokens_per_day": subject.max_tokens_per_day,
                          "max_concurrent_requests": subject.max_concurrent_requests,
                          "models": sorted(subject.models) if subject.models is not None else None}
        daily = subject.daily_limits
        if daily is not None:   # an ask for no tokens: it changes nothing, and says what is left
            left = await services.store.rate_limit(key_id + DAILY_SUFFIX, daily, 0)
            body["tokens_left_today"] = left.remaining_tokens
    return web.Response(body=orjson.dumps(body), content_type="application/json")
