"""The worker's OpenTelemetry traces (`--otlp-traces-endpoint`, as vLLM names it): one SERVER span per API request,
joined to the caller's trace by its W3C `traceparent` header and exported over OTLP/HTTP. No global tracer provider
is installed: the app owns its provider, and flushes it on cleanup. Off (no middleware at all) without an endpoint.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SERVICE_NAME = "switchyard-worker"
TRACED_PREFIX = "/v1/"   # API requests; the gateway's pollers (/health, /load, /kv_events) would drown them

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class WorkerTracing:
    """A tracer provider exporting to `endpoint` (an OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces)."""

    def __init__(self, endpoint: str, service_name: str = SERVICE_NAME) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("switchyard.worker")
        self._propagator = TraceContextTextMapPropagator()

    def middleware(self) -> Middleware:
        """The outermost middleware: its span covers the whole answer (a stream included) and sees its status."""
        tracer, propagator = self._tracer, self._propagator

        @web.middleware
        async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not request.path.startswith(TRACED_PREFIX):
                return await handler(request)
            parent = propagator.extract(request.headers)
            with tracer.start_as_current_span(f"{request.method} {request.path}", context=parent,
                                              kind=trace.SpanKind.SERVER) as span:
                span.set_attribute("http.request.method", request.method)
                span.set_attribute("url.path", request.path)
                response = await handler(request)
                span.set_attribute("http.response.status_code", response.status)
                if response.status >= 500:
                    span.set_status(trace.StatusCode.ERROR)
                return response

        return traced

    async def ctx(self, app: web.Application) -> AsyncIterator[None]:
        """Flush what is still queued when the app stops."""
        yield
        await asyncio.to_thread(self._provider.shutdown)   # one last export: not on the event loop
