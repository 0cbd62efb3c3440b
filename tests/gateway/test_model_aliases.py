"""A model's aliases (`models.M.aliases`), against a real gateway process and its config loader."""
from __future__ import annotations

import aiohttp
import pytest

from gateway.config.gateway_config import ConfigError, parse_config
from tests.gateway.conftest import gateway_config, metric
from tests.gateway.test_security import CHAT, SECRET_A, fetch


async def test_an_alias_is_its_model_under_another_name(start_fakes, start_gateway) -> None:
    """A model's aliases are listed and answered as it, reach its upstreams under its name, and count in its
    metrics; a key that may use the model may use its aliases. Two models may not claim one name."""
    (fake,) = start_fakes("a")
    config = gateway_config({"p": [fake.url]}, api_keys=[{"key_id": "team-a", "key": SECRET_A, "models": ["m"]}],
                            limits={"metrics_public": True})
    config["models"]["m"]["aliases"] = ["gpt-4o-mini"]
    del config["providers"]["p"]["upstream_model"]        # the upstream gets the model's own name
    gateway = start_gateway(config)
    async with aiohttp.ClientSession() as client:
        status, body = await fetch(client, "POST", gateway.url + "/v1/chat/completions", SECRET_A,
                                   json={**CHAT, "model": "gpt-4o-mini"})
        assert status == 200, body
        assert fake.stats()["last_body"]["model"] == "m"
        _, models = await fetch(client, "GET", gateway.url + "/v1/models", SECRET_A)
        assert [m["id"] for m in models["data"]] == ["m", "gpt-4o-mini"]
        status, one = await fetch(client, "GET", gateway.url + "/v1/models/gpt-4o-mini", SECRET_A)
        assert status == 200 and one["id"] == "gpt-4o-mini"
    assert metric(gateway, "switchyard_requests_total", model="m", status="200") == 1
    clash = ("models: {m: {providers: [p], aliases: [x]}, n: {providers: [p], aliases: [m]}}\n"
             "providers: {p: {endpoints: ['http://h:1']}}")
    with pytest.raises(ConfigError, match=r"models\.n\.aliases: 'm' already names model 'm'"):
        parse_config(clash, {})


def test_a_key_may_name_a_model_by_an_alias() -> None:
    """An alias in a key's `models` grants its model, under every name it has (once, however it is named)."""
    text = ("models: {m: {providers: [p], aliases: [gpt-4o-mini]}, n: {providers: [p]}}\n"
            "providers: {p: {endpoints: ['http://h:1']}}\n"
            "api_keys: [{key_id: a, key: s, models: [gpt-4o-mini]}, {key_id: b, key: t, models: [m, gpt-4o-mini, n]}]")
    config = parse_config(text, {})
    assert config.api_keys[0].models == ("m",)
    assert config.api_keys[1].models == ("m", "n")
    with pytest.raises(ConfigError, match=r"api_keys\[0\]\.models: unknown model 'gpt-4'"):
        parse_config(text.replace("models: [gpt-4o-mini]}", "models: [gpt-4]}"), {})
