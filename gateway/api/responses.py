"""POST /v1/responses: OpenAI's Responses API over the same admission, routing and dispatch as chat
completions (`completions.serve`). The translation is gateway/translate/responses.py; this module only wires it
to the request and response. Errors keep OpenAI's shape."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from functools import partial

import orjson
from aiohttp import web

from gateway.api.completions import Surface, check_body, decode_json, read_body, serve
from gateway.api.reencoded import reencoded_response_class
from gateway.errors import UpstreamsFailed
from gateway.routing.response_cache import CACHE_HEADER
from gateway.server.client_stream import SseResponseFactory
from gateway.services import SERVICES
from gateway.translate import responses as openai_responses
from gateway.translate.responses import ResponseEvents, ResponseHeader
from gateway.upstream.request import RoutedRequest

ROUTE = "/v1/responses"


async def create_response(request: web.Request) -> web.StreamResponse:
    started_s = time.perf_counter()
    services = request.app[SERVICES]
    body = decode_json(await read_body(request, services.config.limits.body_timeout_s))
    chat = openai_responses.to_chat_body(body)
    check_body(chat, Surface.CHAT, services.config.limits)
    header = ResponseHeader(f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time()), body)
    outcome = await serve(request, Surface.CHAT, chat, orjson.dumps(chat), started_s,
                          partial(_sse_response, header, reencoded_response_class(request)))
    return _translated(outcome.response, header)


def _translated(response: web.StreamResponse, header: ResponseHeader) -> web.StreamResponse:
    """A whole answer as a Response; an upstream's relayed error stays as it came (OpenAI's shape); a stream
    went out translated."""
    if response.prepared or not isinstance(response, web.Response) or not isinstance(response.body, bytes) \
            or response.status != 200:
        return response
    try:
        body = openai_responses.to_response(orjson.loads(response.body), header)
    except orjson.JSONDecodeError:
        raise UpstreamsFailed("the upstream's answer is not JSON") from None
    kept = {k: v for k, v in response.headers.items() if k == CACHE_HEADER or k.startswith("x-ratelimit-")}
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=kept or None)


def _sse_response(header: ResponseHeader, response_class: Callable[..., web.StreamResponse],
                  routed: RoutedRequest) -> SseResponseFactory:
    return partial(response_class, events=ResponseEvents(header))
