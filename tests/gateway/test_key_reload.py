"""SIGHUP reloads the API keys from the config file (gateway/app.py `reload_keys`): a rotated secret works and
the old one is refused from then on, in one process and in every process of `--workers 2` (the parent passes
the signal on); a file that does not load leaves the keys as they were."""
from __future__ import annotations

import signal
from typing import Any

import aiohttp
import yaml

from tests.gateway.conftest import gateway_config
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import await_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def keyed(fake_url: str, secret: str, **extra: Any) -> dict[str, Any]:
    return gateway_config({"p": [fake_url]}, api_keys=[{"key_id": "team", "key": secret}], **extra)


async def status_with(gateway: GatewayProcess, secret: str) -> int:
    """A new connection each time, so `--workers` processes each take some."""
    async with aiohttp.ClientSession() as client, client.post(
            gateway.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {secret}"}) as answer:
        await answer.read()
        return answer.status


def rewrite(gateway: GatewayProcess, config: dict[str, Any]) -> None:
    """The running gateway's config file with `config`'s api_keys (its port as it was)."""
    current = yaml.safe_load(gateway.config_path.read_text())
    gateway.config_path.write_text(yaml.safe_dump({**current, "api_keys": config["api_keys"]}))


async def test_sighup_rotates_the_keys_and_a_bad_file_changes_nothing(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("e0")
    gateway = start_gateway(keyed(fake.url, "sk-old"))
    assert (await status_with(gateway, "sk-old"), await status_with(gateway, "sk-new")) == (200, 401)
    rewrite(gateway, keyed(fake.url, "sk-new"))
    gateway.send_signal(signal.SIGHUP)

    async def rotated() -> bool:
        return await status_with(gateway, "sk-new") == 200
    await await_until(rotated, "the new key accepted after SIGHUP")
    assert await status_with(gateway, "sk-old") == 401
    gateway.config_path.write_text("models: [")          # broken YAML
    gateway.send_signal(signal.SIGHUP)
    await await_until(lambda: "does not load" in gateway.log(), "the bad file reported")
    assert await status_with(gateway, "sk-new") == 200 and gateway.alive


async def test_every_process_of_workers_reloads(start_fakes, start_gateway, redis_server) -> None:
    (fake,) = start_fakes("e0")
    gateway = start_gateway(keyed(fake.url, "sk-old", redis_url=redis_server.url), args=("--workers", "2"))
    await await_until(lambda: gateway.log().count("switchyard gateway listening") == 2, "both processes serving")
    rewrite(gateway, keyed(fake.url, "sk-new"))
    gateway.send_signal(signal.SIGHUP)

    await await_until(lambda: gateway.log().count("SIGHUP: 1 API keys loaded") == 2, "both processes reloaded")
    assert [await status_with(gateway, "sk-old") for _ in range(16)] == [401] * 16
    assert [await status_with(gateway, "sk-new") for _ in range(16)] == [200] * 16
