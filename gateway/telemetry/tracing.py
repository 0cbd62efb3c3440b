"""Request ids (a contextvar, a logging filter) and the OpenTelemetry tracer built from config.

No global tracer provider is installed: the app owns its provider and shuts it down on cleanup.
"""
from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.propagate import extract, inject

from gateway.config.gateway_config import TracingConfig, TracingExporter

REQUEST_ID_HEADER = "x-request-id"

# Reusable: nullcontext keeps no state, so one instance serves every request.
_NO_SPAN: AbstractContextManager[Any] = nullcontext()

# The id of the request being handled by the current task ("-" outside a request).
request_id_var: ContextVar[str] = ContextVar("request_id", default="-")


class RequestIds:
    """Generates request ids: a random per-app prefix and a counter (unique across replicas, cheap)."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count()

    def new(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id` so every log line can print it (`%(request_id)s`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def configure_logging(level: str, json_lines: bool = False) -> None:
    """Called once by the CLI: every log line carries the request id; `json_lines`: one JSON object a line."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonLines() if json_lines else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class JsonLines(logging.Formatter):
    """`log_format: json`: time (UTC), level, logger, request id, message, and the traceback where there is one,
    as one JSON object a line, for a log pipeline to read without patterns."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, UTC),
                "level": record.levelname, "logger": record.name,
                "request_id": getattr(record, "request_id", "-"), "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, option=orjson.OPT_UTC_Z).decode()


class Tracing:
    """The app's tracer; `none` uses the no-op tracer so spans cost almost nothing."""

    def __init__(self, config: TracingConfig) -> None:
        self._provider = None
        if config.exporter is TracingExporter.NONE:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            self.enabled = False
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

        exporter: SpanExporter
        if config.exporter is TracingExporter.OTLP:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint) if config.otlp_endpoint else OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        self._provider = provider
        self.tracer = provider.get_tracer("switchyard.gateway")
        self.enabled = True

    def span(self, name: str, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
             incoming: Mapping[str, str] | None = None) -> AbstractContextManager[Any]:
        """A span made current for the block; a shared no-op context when tracing is off (hot path). `kind`:
        SERVER for the client's request, CLIENT for a call upstream (whose `traceparent` names it). `incoming`:
        the client's headers, whose `traceparent` (W3C) the span continues, so a caller's trace goes on through
        the gateway; without one the span starts a trace."""
        if not self.enabled:
            return _NO_SPAN
        parent = extract(incoming) if incoming is not None else None
        return self.tracer.start_as_current_span(name, context=parent, kind=kind)

    def inject_headers(self, headers: dict[str, str]) -> None:
        """Add `traceparent` for the current span so upstreams can join the trace."""
        if self.enabled:
            inject(headers)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
