"""The access log (gateway/server/access_log.py) of a real gateway process: one JSON line per API request, refused or
served, whole or streamed, with its key, model, endpoint, tokens, status and timings; none for probes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.gateway.conftest import gateway_config
from tests.support.wait import await_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
KEY = "sk-log-5a1e"


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


async def test_each_api_request_is_one_line(start_fakes, start_gateway, tmp_path: Path) -> None:
    (fake,) = start_fakes("e0")
    log_path = tmp_path / "access.jsonl"
    gateway = start_gateway(gateway_config({"p": [fake.url]}, access_log=str(log_path),
                                           api_keys=[{"key_id": "team-a", "key": KEY}]))
    auth = {"Authorization": f"Bearer {KEY}"}
    ids = []
    async with aiohttp.ClientSession() as client:
        for headers, body in ((auth, CHAT), (auth, {**CHAT, "stream": True}), ({}, CHAT),
                              (auth, {**CHAT, "model": "nope"}), (auth, {**CHAT, "max_tokens": "x"})):
            async with client.post(gateway.url + "/v1/chat/completions", json=body, headers=headers) as response:
                await response.read()
                ids.append((response.status, response.headers["x-request-id"]))
        for path in ("/health", "/ready"):
            async with client.get(gateway.url + path) as response:
                assert response.status == 200
        # a client that leaves mid-stream
        slow = {**CHAT, "stream": True, "fake": {"chunks": 400, "chunk_delay_s": 0.05}}
        async with client.post(gateway.url + "/v1/chat/completions", json=slow, headers=auth) as response:
            await response.content.readline()
            ids.append((499, response.headers["x-request-id"]))
    def all_logged() -> list[dict[str, Any]] | None:
        got = lines(log_path)
        return got if len(got) == len(ids) else None
    logged = await await_until(all_logged, "a line for each API request", timeout_s=30)
    assert [(line["status"], line["request_id"]) for line in logged] == ids, logged
    whole, stream, no_key, no_model, bad, gone = logged
    assert whole["key_id"] == "team-a" and whole["model"] == "m" and whole["endpoint"] == fake.url
    assert (whole["prompt_tokens"], whole["cached_tokens"], whole["completion_tokens"]) == (7, 3, 3)
    assert whole["stream"] is False and whole["ttft_ms"] is None and whole["path"] == "/v1/chat/completions"
    assert stream["stream"] is True and stream["completion_tokens"] == 3
    assert 0 < stream["ttft_ms"] <= stream["duration_ms"]
    assert no_key["key_id"] is None and no_key["model"] is None
    assert no_model["key_id"] == "team-a" and no_model["model"] is None and bad["status"] == 400
    assert gone["stream"] is True and 0 < gone["completion_tokens"] < 400
    assert all(line["time"].endswith("Z") and line["duration_ms"] >= 0 for line in logged)
