"""The access log (`access_log` in the config): one JSON object per line for each API request, whatever its
outcome: who asked, for which model, which endpoint served it, its tokens, status and timings.

A middleware inside the error middleware (so the request id is known and a refusal's status is seen) opens an
`AccessRecord` that `gateway/api/completions.py` fills as the request goes; the line is written when the
request ends (a stream: when it has been relayed). Lines go to a file opened for appending, one `write` each,
so the processes of `switchyard gateway --workers N` can share it; or to standard output (`-`).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from gateway.errors import GatewayError
from gateway.server.client_stream import StreamUsage
from gateway.server.middlewares import caller_key
from gateway.telemetry.tracing import request_id_var

ACCESS_RECORD: web.RequestKey[AccessRecord] = web.RequestKey("switchyard_access_record", object)  # type: ignore[arg-type]
_LOGGED_PREFIX = "/v1/"           # the API; probes, metrics and the status page are not logged

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AccessRecord:
    """What the handler learns about its request, for its line (None: not reached)."""

    __slots__ = ("cache", "counted_prompt_tokens", "endpoint", "first_data_s", "model", "status", "stream", "usage")

    def __init__(self) -> None:
        self.model: str | None = None
        self.counted_prompt_tokens: int | None = None   # the gateway's count, where the upstream gives none
        self.stream: bool | None = None
        self.endpoint: str | None = None        # the endpoint that answered (None: none did, or the cache)
        self.usage: StreamUsage | None = None
        self.cache: str | None = None           # the response cache's hit | miss | bypass, where it was asked
        self.first_data_s: float | None = None  # perf_counter when a stream's first data went to the client
        self.status: int | None = None          # as the metrics count it (a stream's client that left: 499)

    def ended(self, status: int, endpoint: str | None, usage: StreamUsage, first_data_s: float | None) -> None:
        self.status, self.endpoint, self.usage, self.first_data_s = status, endpoint, usage, first_data_s


class AccessLog:
    """Its file is opened when the app starts (`open`), not when it is built (`switchyard gateway --check`)."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._fd: int | None = None

    def open(self) -> None:
        target = self._target
        self._fd = 1 if target == "-" else os.open(Path(target), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)

    def close(self) -> None:
        if self._fd is not None and self._fd != 1:
            os.close(self._fd)
        self._fd = None

    def write(self, line: dict[str, Any]) -> None:
        if self._fd is not None:
            os.write(self._fd, orjson.dumps(line, option=orjson.OPT_UTC_Z | orjson.OPT_APPEND_NEWLINE))

    def middleware(self) -> Any:
        @web.middleware
        async def access_log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not request.path.startswith(_LOGGED_PREFIX):
                return await handler(request)
            started_s, started_at = time.perf_counter(), time.time()
            record = request[ACCESS_RECORD] = AccessRecord()
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            except (GatewayError, web.HTTPException) as exc:
                status = exc.status
                raise
            except (asyncio.CancelledError, ConnectionResetError):
                status = 499                    # the client went away
                raise
            finally:
                self.write(_line(request, record, record.status or status, started_at, started_s))

        return access_log_middleware


def _line(request: web.Request, record: AccessRecord, status: int, started_at: float,
          started_s: float) -> dict[str, Any]:
    now_s = time.perf_counter()
    key = caller_key(request)
    usage = record.usage
    return {
        "time": datetime.fromtimestamp(started_at, UTC),   # orjson writes it (RFC 3339, µs, Z): 5× cheaper
        "request_id": request_id_var.get(), "key_id": key.key_id if key is not None else None,
        "method": request.method, "path": request.path, "status": status, "model": record.model,
        "stream": record.stream, "endpoint": record.endpoint, "cache": record.cache,
        "prompt_tokens": usage.num_prompt_tokens if usage is not None and usage.num_prompt_tokens is not None
        else record.counted_prompt_tokens,
        "cached_tokens": usage.num_cached_tokens if usage is not None else None,
        "completion_tokens": usage.num_output_tokens if usage is not None else None,
        "ttft_ms": round((record.first_data_s - started_s) * 1e3, 3) if record.first_data_s is not None else None,
        "duration_ms": round((now_s - started_s) * 1e3, 3),
    }
