"""switchyard_tokens_total{model, key, kind} of a real gateway process: the tokens upstreams served, from their
usage (or the gateway's own counts where a stream carries none), per API key; nothing for what no upstream
served (a refusal, a failed leg)."""
from __future__ import annotations

import aiohttp

from tests.gateway.conftest import gateway_config, metric
from tests.support.wait import await_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


async def test_tokens_are_counted_by_model_key_and_kind(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, limits={"metrics_public": True},
                                           api_keys=[{"key_id": "team-a", "key": "sk-a"}]))

    def tokens(kind: str) -> float:
        return metric(gateway, "switchyard_tokens_total", model="m", key="team-a", kind=kind)

    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-a"}) as client:
        async def post(path: str, body: dict) -> int:
            async with client.post(gateway.url + path, json=body) as response:
                await response.read()
                return response.status

        assert await post("/v1/chat/completions", CHAT) == 200      # the fake's usage: 7 prompt (3 cached), 3
        assert (tokens("prompt"), tokens("cached"), tokens("completion")) == (7, 3, 3)
        assert await post("/v1/chat/completions", {**CHAT, "stream": True}) == 200   # no usage: counted here
        # counted once the upstream's body has ended, which may come after the client has the whole stream
        await await_until(lambda: tokens("completion") == 6, "the stream's tokens counted")
        assert tokens("prompt") > 7 and tokens("cached") == 3
        prompt = tokens("prompt")
        assert await post("/v1/embeddings", {"model": "m", "input": "one two"}) == 200   # 2 prompt tokens, no output
        assert (tokens("prompt"), tokens("completion")) == (prompt + 2, 6)
        assert await post("/v1/chat/completions", {**CHAT, "model": "nope"}) == 404
        assert await post("/v1/chat/completions", {**CHAT, "fake": {"status": 500}}) == 502
        assert (tokens("prompt"), tokens("cached"), tokens("completion")) == (prompt + 2, 3, 6)
