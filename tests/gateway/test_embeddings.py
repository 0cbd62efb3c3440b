"""POST /v1/embeddings through a real gateway process: validated, counted, limited and routed as a prompt with no
output, down the model's provider chain (an `anthropic` provider has no embeddings and hands it on; a
`switchyard-pd` provider sends it whole to a decode worker), with usage recorded and the response cache's
answer. Fake upstreams stand in for the providers here; tests/test_gateway_to_worker.py has the real worker."""
from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from gateway.routing.response_cache import CACHE_HEADER
from tests.gateway.conftest import gateway_config
from tests.gateway.test_pd import pd_config
from tests.support.wait import await_until

KEY = "sk-embed-2c9d"
INPUTS = ["one two three", "four"]


async def post(url: str, body: dict[str, Any], key: str | None = None) -> tuple[int, dict[str, Any], str | None]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as client, \
            client.post(url + "/v1/embeddings", json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None), response.headers.get(CACHE_HEADER)


def test_the_sdk_gets_vectors_from_the_provider(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}))
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    reply = client.embeddings.create(model="m", input=INPUTS, encoding_format="float")
    assert [d.embedding for d in reply.data] == [[0.0, 3.0], [1.0, 1.0]]     # the fake's [index, words]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == 4
    sent = fake.stats()
    assert sent["num_requests"] == 1 and sent["models"] == ["p-upstream"]     # renamed for the provider
    assert sent["last_body"]["input"] == INPUTS and "stream" not in sent["last_body"]


async def test_bad_input_is_refused_before_any_upstream(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}))
    for body, param in (({"model": "m"}, "input"), ({"model": "m", "input": ""}, "input"),
                        ({"model": "m", "input": []}, "input"), ({"model": "m", "input": [[]]}, "input"),
                        ({"model": "m", "input": [1, "a"]}, "input"), ({"model": "m", "input": {"a": 1}}, "input"),
                        ({"model": "m", "input": "a", "stream": True}, "stream"), ({"input": "a"}, "model"),
                        ({"model": "m", "input": "a", "kv_transfer_params": {}}, "kv_transfer_params")):
        status, answer, _ = await post(gateway.url, body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    status, answer, _ = await post(gateway.url, {"model": "nope", "input": "a"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    assert fake.stats()["num_requests"] == 0


async def test_down_the_chain_past_what_cannot_serve_it(start_fakes, start_gateway) -> None:
    """An anthropic provider is passed over without a leg; a failing provider falls back to the next; a chain
    with nothing that serves embeddings is a 400, not an outage."""
    broken, good = start_fakes("broken", "good")
    broken.control(behaviour={"status": 500})
    config = gateway_config({"p": [broken.url], "q": [good.url]}, chain=["claude", "p", "q"])
    config["providers"]["claude"] = {"kind": "anthropic", "endpoints": [broken.url], "health_path": None}
    config["models"]["claude-only"] = {"providers": ["claude"]}
    gateway = start_gateway(config)
    status, answer, _ = await post(gateway.url, {"model": "m", "input": INPUTS})
    assert status == 200 and answer["served_by"] == "good", answer
    assert broken.stats()["num_requests"] >= 1 and good.stats()["num_requests"] == 1
    reached = broken.stats()["num_requests"]
    status, answer, _ = await post(gateway.url, {"model": "claude-only", "input": "a"})
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert broken.stats()["num_requests"] == reached


async def test_a_disaggregated_provider_sends_them_whole_to_a_decode_worker(start_fakes, start_gateway) -> None:
    (prefill,) = start_fakes("prefill", role="prefill")
    (decode,) = start_fakes("decode", role="decode")
    gateway = start_gateway(pd_config([prefill], [decode]))
    status, answer, _ = await post(gateway.url, {"model": "m", "input": INPUTS})
    assert status == 200 and answer["served_by"] == "decode", answer
    assert prefill.stats()["num_requests"] == 0 and decode.stats()["num_requests"] == 1


@pytest.mark.parametrize("redis", [False, True], ids=["in-process", "redis"])
async def test_usage_counts_the_prompt_and_the_cache_answers_repeats(start_fakes, start_gateway, redis_server,
                                                                     redis: bool) -> None:
    """Embeddings are never sampled: a repeat is a cache hit with no temperature or seed. Usage records the
    provider's prompt tokens (and no output), and a hit records nothing."""
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, response_cache={"ttl_s": 60},
                                           redis_url=redis_server.url if redis else None,
                                           api_keys=[{"key_id": "k", "key": KEY, "max_tokens_per_min": 1000}]))
    body = {"model": "m", "input": INPUTS}
    status, first, state = await post(gateway.url, body, KEY)
    assert (status, state) == (200, "miss")

    async def hit() -> dict[str, Any] | None:
        status, answer, state = await post(gateway.url, body, KEY)
        return answer if status == 200 and state == "hit" else None
    assert await await_until(hit, "a repeat answered from the cache") == first
    assert fake.stats()["num_requests"] >= 1
    asked = fake.stats()["num_requests"]         # repeats before the entry was kept reached the upstream

    async def usage() -> dict[str, Any]:
        async with aiohttp.ClientSession() as client, \
                client.get(gateway.url + "/v1/usage", headers={"Authorization": f"Bearer {KEY}"}) as response:
            return await response.json()

    async def recorded() -> bool:   # with Redis, a request's usage is recorded by a task of its own after the answer
        return (await usage())["num_prompt_tokens"] == 4 * asked
    await await_until(recorded, f"{4 * asked} prompt tokens recorded")
    assert (await usage())["num_completion_tokens"] == 0
