"""OpenTelemetry end to end: a real gateway and a real worker (bundled SmolLM2) both export over OTLP/HTTP to a
receiver this test runs, and one chat request yields one trace: the gateway's SERVER span, its CLIENT span for the
upstream call, and the worker's SERVER span, a child of that CLIENT span through `traceparent`. A request that
carries its caller's `traceparent` continues the caller's trace.
"""
from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.wait import await_until
from tests.support.worker_proc import WorkerProcess

FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}   # ms between the batch processor's exports (default 5000)
CLIENT_TRACE_ID, CLIENT_SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"   # W3C: a caller's own trace


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str        # the exporter's resource `service.name`
    name: str
    kind: int           # opentelemetry.proto.trace.v1.Span.SpanKind
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes


class Receiver:
    """An OTLP/HTTP traces receiver: POST /v1/traces, protobuf bodies (gzip or not), every span kept."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                self.spans += [ReceivedSpan(service, s.name, s.kind, s.trace_id, s.span_id, s.parent_span_id)
                               for s in scope_spans.spans]
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    rec.url = f"http://127.0.0.1:{port}/v1/traces"
    yield rec
    await runner.cleanup()


async def test_one_request_is_one_trace_across_gateway_and_worker(receiver: Receiver, smollm2_dir: Path,
                                                                   tmp_path: Path) -> None:
    worker = WorkerProcess(["--threads", "1", "--num-blocks", "64", "--served-model-name", "smollm2"],
                           env={**FAST_EXPORT, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url.removesuffix("/v1/traces")},
                           log_dir=tmp_path)
    gateway = None
    try:
        config = {"models": {"smollm2": {"tokenizer": str(smollm2_dir), "providers": ["local"]}},
                  "providers": {"local": {"kind": "openai", "endpoints": [worker.url]}},
                  "tracing": {"exporter": "otlp", "otlp_endpoint": receiver.url, "service_name": "switchyard-gateway"}}
        gateway = GatewayProcess(config, tmp_path, env=FAST_EXPORT)
        async with aiohttp.ClientSession() as session, session.post(
                gateway.url + "/v1/chat/completions",
                json={"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}],
                      "max_tokens": 4, "temperature": 0}) as response:
            assert response.status == 200, await response.text()

        def joined() -> list[ReceivedSpan]:
            roots = [s for s in receiver.spans if s.name == "request"]
            return [s for s in receiver.spans if roots and s.trace_id == roots[0].trace_id]

        def worker_arrived() -> list[ReceivedSpan]:
            trace = joined()
            return trace if any(s.service == "switchyard-worker" for s in trace) else []

        trace = await await_until(worker_arrived, "the gateway's and the worker's spans to arrive")
        (root,) = [s for s in receiver.spans if s.name == "request"]   # one request, one gateway request span
        async with aiohttp.ClientSession() as session, session.post(
                gateway.url + "/v1/chat/completions", headers={"traceparent": CLIENT_TRACEPARENT},
                json={"model": "smollm2", "messages": [{"role": "user", "content": "Say hi."}],
                      "max_tokens": 2, "temperature": 0}) as response:
            assert response.status == 200, await response.text()
        continued = await await_until(lambda: [s for s in receiver.spans if s.name == "request" and s is not root],
                                      "the second request's span to arrive")
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
    assert root.kind == SpanProto.SPAN_KIND_SERVER and root.parent_span_id == b"", root
    (served,) = [s for s in trace if s.service == "switchyard-worker"]
    assert served.name == "POST /v1/chat/completions" and served.kind == SpanProto.SPAN_KIND_SERVER
    by_id = {s.span_id: s for s in receiver.spans}
    caller = by_id[served.parent_span_id]   # the worker's parent is a span the gateway exported
    assert caller.service == "switchyard-gateway" and caller.name == "upstream_attempt", caller
    assert caller.kind == SpanProto.SPAN_KIND_CLIENT
    assert root.service != served.service
    assert {s.service for s in trace} == {"switchyard-gateway", "switchyard-worker"}, trace
    ancestor = caller
    while ancestor.parent_span_id:   # the upstream call lies under the gateway's request span
        ancestor = by_id[ancestor.parent_span_id]
    assert ancestor is root

    (request_span,) = continued   # a client's `traceparent` is continued, not replaced
    assert request_span.trace_id.hex() == CLIENT_TRACE_ID and request_span.parent_span_id.hex() == CLIENT_SPAN_ID
