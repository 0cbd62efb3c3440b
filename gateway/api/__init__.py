"""HTTP handlers, one module per API surface; `routes()` is the gateway's one route table."""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from gateway.api import completions, messages, models, openapi, ops, responses, usage


def lean_routes() -> Mapping[str, Callable[[Any], Awaitable[web.StreamResponse]]]:
    """The POST routes that gateway/server/lean_http.py serves itself (the same handlers as in `routes`)."""
    return {"/v1/chat/completions": completions.chat_completions, "/v1/completions": completions.completions,
            "/v1/embeddings": completions.embeddings, messages.ROUTE: messages.create_message,
            responses.ROUTE: responses.create_response}


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/chat/completions", completions.chat_completions),
        web.post("/v1/completions", completions.completions),
        web.post("/v1/embeddings", completions.embeddings),
        web.post(messages.ROUTE, messages.create_message),
        web.post(responses.ROUTE, responses.create_response),
        web.get("/v1/models", models.list_models),
        web.get("/v1/models/{model:.+}", models.get_model),
        web.post(messages.COUNT_TOKENS_ROUTE, messages.count_tokens),
        web.get("/v1/usage", usage.get_usage),
        web.get("/health", ops.health),
        web.get("/ready", ops.ready),
        web.get("/metrics", ops.metrics),
        web.get("/openapi.json", openapi.handler()),
    ]
