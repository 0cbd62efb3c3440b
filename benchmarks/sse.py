"""The data chunks of an OpenAI streaming response, for the benchmarks that time one."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson


async def data_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Each `data: {...}` event parsed, as it arrives; `[DONE]` and other lines skipped."""
    resp.raise_for_status()
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            yield orjson.loads(line[5:])
