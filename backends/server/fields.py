"""Reading a request body: the body itself as JSON (`read_json`, the one way a handler reads one), and typed
readers of one optional field of it, each returning the value (None when absent) or raising the OpenAI-style
400 naming the field (`backends/server/protocol.py` uses them)."""
from __future__ import annotations

import math
from typing import Any, TypeVar

import orjson
from aiohttp import web

from backends.server.errors import APIError, invalid_param

_T = TypeVar("_T")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default(value: _T | None, fallback: _T) -> _T:
    return fallback if value is None else value


def opt_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid_param(name, f"`{name}` must be a boolean.")
    return value


def opt_int(body: dict[str, Any], name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value):
        raise invalid_param(name, f"`{name}` must be an integer.")
    if (low is not None and value < low) or (high is not None and value > high):
        raise invalid_param(name, f"`{name}` must be in [{low}, {high}], got {value}.")
    return value


def opt_float(
    body: dict[str, Any], name: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise invalid_param(name, f"`{name}` must be a number.")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid_param(name, f"`{name}` must be in {bracket}{low}, {high}], got {value}.")
    return float(value)


async def read_json(request: web.Request) -> object:
    """The decoded body; 400 when it is not JSON (413 comes from aiohttp's size limit)."""
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(f"The request body is not valid JSON: {exc}", code="invalid_json") from exc
