"""The worker's aiohttp app factory: typed state, engine/tokenizer lifetimes, the error and drain middlewares,
routes.

Run it with `handler_cancellation=True` (as `__main__` does) so that a client that goes away
cancels its handler and thereby aborts its sequence.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus

from aiohttp import web
from aiohttp.typedefs import Middleware

from backends.core.engine_config import EngineConfig
from backends.core.engine_errors import EngineDeadError
from backends.kv_connectors.pd_connector import PDConnector
from backends.server import auth, disagg, embeddings, openai_routes, openapi, ops_routes, status
from backends.server.app_keys import CONFIG_KEY, ENGINE_KEY, METRICS_KEY, TOKENIZER_KEY, WorkerEngine
from backends.server.errors import APIError, ErrorType, error_body
from backends.server.metrics import EngineCollector, ServerMetrics
from backends.server.server_config import ServerConfig
from backends.server.tokenization import PromptTokenizer

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], WorkerEngine]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# Routes a draining worker still serves: probes, scrapes and the gateway's pollers.
_ALWAYS = frozenset({"/metrics", "/load", "/kv_events", "/kv_holds/release"})   # a release speeds the drain


class Drain:
    """Counts the HTTP requests in flight; `draining` turns new ones away."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0

    def middleware(self) -> Middleware:
        @web.middleware
        async def drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path in _ALWAYS:
                return await handler(request)
            if self.draining:
                raise APIError("This worker is shutting down; retry the request on another worker.",
                               status=HTTPStatus.SERVICE_UNAVAILABLE, error_type=ErrorType.UNAVAILABLE,
                               code="shutting_down")
            self.num_in_flight += 1
            try:
                return await handler(request)
            finally:
                self.num_in_flight -= 1

        return drain_middleware


DRAIN: web.AppKey[Drain] = web.AppKey("switchyard_worker_drain", Drain)


def create_app(
    config: ServerConfig, engine_config: EngineConfig, engine_factory: EngineFactory | None = None
) -> web.Application:
    """A worker app; the engine starts in the app's start-up and shuts down in its cleanup."""
    drain = Drain()
    tracing = None
    if config.otlp_traces_endpoint:
        from backends.server.tracing import WorkerTracing  # opentelemetry loads only where traces are wanted

        tracing = WorkerTracing(config.otlp_traces_endpoint)
    middlewares = [*([tracing.middleware()] if tracing else []), error_middleware,
                   *([auth.middleware(config.api_key)] if config.api_key else []), drain.middleware()]
    app = web.Application(client_max_size=config.max_request_bytes, middlewares=middlewares)
    if tracing is not None:
        app.cleanup_ctx.append(tracing.ctx)
    app[CONFIG_KEY] = config
    app[DRAIN] = drain
    app[TOKENIZER_KEY] = PromptTokenizer.from_model_dir(config.model_dir)
    app.cleanup_ctx.append(_engine_ctx(engine_config, engine_factory or _default_factory))
    app.cleanup_ctx.append(disagg.kv_transfer_ctx(config))   # after the engine: it serves the engine's KV
    app.router.add_routes([
        web.post("/v1/completions", openai_routes.completions),
        web.post("/v1/chat/completions", openai_routes.chat_completions),
        web.post("/v1/embeddings", embeddings.embeddings),
        web.get("/v1/models", openai_routes.models),
        web.get("/v1/models/{model}", openai_routes.model),
        web.get("/health", ops_routes.health),
        web.get("/metrics", ops_routes.metrics),
        web.get("/load", ops_routes.load),
        web.get("/kv_events", ops_routes.kv_events),
        web.post("/kv_holds/release", disagg.release_hold),
        web.get("/openapi.json", openapi.handler()),
        *status.routes(),
    ])
    if config.debug_endpoints:
        app.router.add_get("/debug/kv_digest", disagg.kv_digest)
    return app


def _default_factory(engine_config: EngineConfig) -> WorkerEngine:
    """The engine builds the KV connectors `engine_config.kv_connector_names` names (the P/D connector on
    every role: backends/server/__main__.py)."""
    from backends.engine.async_engine import AsyncEngine  # torch and the model load only when serving

    return AsyncEngine(engine_config)


def _engine_ctx(
    engine_config: EngineConfig, engine_factory: EngineFactory
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        engine = engine_factory(engine_config)
        await engine.start()
        await engine.warm_structured_output()   # before serving: not on a running stream's time
        app[ENGINE_KEY] = engine
        pd_connector = engine.find_kv_connector(PDConnector)
        if pd_connector is not None:   # else the worker serves no disaggregated leg (disagg.py)
            app[disagg.PD_CONNECTOR_KEY] = pd_connector
        app[METRICS_KEY] = ServerMetrics(EngineCollector(engine.load_report, engine.stats),
                                         engine.weights_fingerprint())
        log.info("engine started: max_model_len=%d block_size=%d", engine.max_model_len, engine.block_size)
        try:
            yield
        finally:
            await engine.shutdown()
            log.info("engine shut down")

    return engine_ctx


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every exception becomes an OpenAI-style error body; unexpected ones are logged as 500s."""
    try:
        response = await handler(request)
    except APIError as exc:
        response = openai_routes.json_response(exc.body(), exc.status)
    except EngineDeadError as exc:   # a tensor-parallel group lost a rank: /health says 503 too
        err = APIError(f"This worker's engine failed ({exc}); retry the request on another worker.",
                       status=HTTPStatus.SERVICE_UNAVAILABLE, error_type=ErrorType.UNAVAILABLE, code="engine_dead")
        response = openai_routes.json_response(err.body(), err.status)
    except web.HTTPException as exc:
        response = _http_error(exc)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        response = openai_routes.json_response(
            error_body("Internal server error.", ErrorType.SERVER), HTTPStatus.INTERNAL_SERVER_ERROR
        )
    metrics = request.app.get(METRICS_KEY)
    if metrics is not None:
        metrics.observe_request(_route_name(request), response.status)
    return response


def _http_error(exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors (404, 405, 413...) in the OpenAI envelope."""
    if exc.status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE:
        err = APIError(exc.text or "Request body too large.", status=exc.status, code="request_too_large")
    elif exc.status == HTTPStatus.NOT_FOUND:
        err = APIError("Not found.", status=exc.status, error_type=ErrorType.NOT_FOUND)
    else:
        err = APIError(exc.reason, status=exc.status)
    response = openai_routes.json_response(err.body(), err.status)
    if exc.status == HTTPStatus.METHOD_NOT_ALLOWED and "Allow" in exc.headers:
        response.headers["Allow"] = exc.headers["Allow"]
    return response


def _route_name(request: web.Request) -> str:
    """The route's path pattern, so that label values stay bounded whatever paths clients try."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"
