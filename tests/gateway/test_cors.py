"""Browsers' cross-origin requests (`cors`, gateway/server/middlewares.py) against a real gateway process: a
preflight from an allowed origin, answers whole, streamed and refused with the headers a page needs, and nothing
for an origin that is not allowed."""
from __future__ import annotations

import aiohttp

from tests.gateway.conftest import gateway_config

APP = "https://app.example.com"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_an_allowed_origin_may_call_and_read_the_answers(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, cors={"allow_origins": [APP], "max_age_s": 60},
                                           api_keys=[{"key_id": "k", "key": "sk-cors"}]))
    url = gateway.url + "/v1/chat/completions"
    preflight = {"Origin": APP, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    async with aiohttp.ClientSession() as client:
        async with client.options(url, headers=preflight) as response:      # no key: browsers send none here
            assert response.status == 204
            assert response.headers["Access-Control-Allow-Origin"] == APP
            assert "POST" in response.headers["Access-Control-Allow-Methods"]
            assert response.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            assert response.headers["Access-Control-Max-Age"] == "60"
        async with client.options(url, headers={**preflight, "Origin": "https://evil.example"}) as response:
            assert response.status == 403 and "Access-Control-Allow-Origin" not in response.headers
        for body, key in ((CHAT, "sk-cors"), ({**CHAT, "stream": True}, "sk-cors"), (CHAT, "wrong")):
            async with client.post(url, json=body, headers={"Origin": APP, "Authorization": f"Bearer {key}"}) as r:
                await r.read()
                assert r.status == (200 if key == "sk-cors" else 401)
                assert r.headers["Access-Control-Allow-Origin"] == APP and r.headers["Vary"] == "Origin"
                assert "x-request-id" in r.headers["Access-Control-Expose-Headers"]
        async with client.post(url, json=CHAT, headers={"Origin": "https://evil.example",
                                                         "Authorization": "Bearer sk-cors"}) as response:
            assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers
    assert fake.stats()["num_requests"] == 3


async def test_without_cors_no_header_is_added(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}))
    async with aiohttp.ClientSession() as client, client.post(gateway.url + "/v1/chat/completions", json=CHAT,
                                                             headers={"Origin": APP}) as response:
        assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers
