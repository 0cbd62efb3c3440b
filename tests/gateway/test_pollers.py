"""The pollers feed routing: `/kv_events` into the prefix index (prefix_aware routes to the cached
endpoint), `/load` into the load tracker (least_tokens avoids a worker busy with others' work). A poll
whose answer does not parse is a warning (once) and a counted failure, never a silent debug line."""
from __future__ import annotations

import aiohttp
import orjson

from cache.block_hash import block_hashes
from tests.gateway.conftest import gateway_config, metric
from tests.support.wait import await_until

PROMPT_IDS = list(range(100, 164))  # 4 blocks of 16 token ids


async def served_by(client: aiohttp.ClientSession, url: str, body: dict) -> str:
    async with client.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200
        return orjson.loads(await response.read())["served_by"]


async def test_kv_events_steer_prefix_aware_routing(start_fakes, start_gateway) -> None:
    fakes = start_fakes("a", "b", "c")
    config = gateway_config({"p": [f.url for f in fakes]}, policy="prefix_aware")
    config["providers"]["p"]["offers_kv_events"] = True
    gateway = start_gateway(config)
    hashes = block_hashes(PROMPT_IDS, 16)
    fakes[2].control(kv_stored=hashes)  # events exactly as a worker writes them (seq_no 1..4)
    # The poller asks for events after the last one it applied: once it asks from 4, all four are indexed.
    await await_until(lambda: (fakes[2].stats()["kv_since"] or 0) >= len(hashes), "the kv events to be applied")
    async with aiohttp.ClientSession() as client:
        homes = [await served_by(client, gateway.url, {"model": "m", "prompt": PROMPT_IDS}) for _ in range(4)]
        other = await served_by(client, gateway.url, {"model": "m", "prompt": list(range(500, 564))})
    assert homes == ["c"] * 4
    assert metric(gateway, "switchyard_routing_decisions_total", reason="prefix_hit") == 4
    assert other in {"a", "b", "c"}
    assert metric(gateway, "switchyard_poll_failures_total", poller="kv_events") == 0


async def test_a_device_hit_outranks_a_tier_hit_of_the_same_length(start_fakes, start_gateway) -> None:
    """Our workers' events name the medium: the same 4 blocks on a's device, in b's host RAM and on c's disk
    go to a; with only b's and c's copies, to b; 2 blocks on a's device lose to 4 in b's RAM (0.8 x 4 > 2)."""
    fakes = start_fakes("a", "b", "c")
    config = gateway_config({"p": [f.url for f in fakes]}, policy="prefix_aware")
    config["providers"]["p"]["offers_kv_events"] = True
    gateway = start_gateway(config)
    prompts = [list(range(k * 1000, k * 1000 + 64)) for k in range(3)]  # 4 blocks of 16 each
    first, second, third = (block_hashes(p, 16) for p in prompts)
    fakes[0].control(kv_stored=first)
    fakes[0].control(kv_stored=third[:2])
    for fake, medium in ((fakes[1], "cpu"), (fakes[2], "disk")):
        for hashes in (first, second, third):
            fake.control(kv_stored=hashes, kv_medium=medium)
    await await_until(lambda: [(f.stats()["kv_since"] or 0) for f in fakes] == [6, 12, 12],
                      "the kv events to be applied")
    async with aiohttp.ClientSession() as client:
        served = [await served_by(client, gateway.url, {"model": "m", "prompt": p}) for p in prompts]
    assert served == ["a", "b", "b"]
    assert metric(gateway, "switchyard_routing_decisions_total", reason="prefix_hit") == 3


async def test_a_workers_measured_restore_cost_sets_its_tier_blocks_worth(start_fakes, start_gateway) -> None:
    """a holds 3 of the prompt's 4 blocks on its device, b all 4 on disk. At the fixed disk weight (0.5 x 4 = 2 < 3)
    a wins; once b's /load says a disk read costs 0.02 of computing the tokens (0.98 x 4 > 3), b does, and the
    gateway's /status.json shows the figure it weighs b's disk by. With measured weights off, a again."""
    prompt = list(range(3000, 3064))
    hashes = block_hashes(prompt, 16)
    report = {"num_running": 0, "num_waiting": 0, "num_prefill_tokens_pending": 0, "num_decode_tokens_pending": 0,
              "num_free_blocks": 100, "num_total_blocks": 100, "num_cached_blocks": 4, "block_size": 16}
    served = {}
    for measured in (True, False):
        a, b = start_fakes("a", "b")
        a.control(kv_stored=hashes[:3], load_report=report)
        b.control(kv_stored=hashes, kv_medium="disk", load_report=report)
        config = gateway_config({"p": [a.url, b.url]}, policy="prefix_aware")
        config["providers"]["p"].update(offers_kv_events=True, offers_load=True)
        config["models"]["m"]["policy"]["options"] = {"measured_tier_weights": measured}
        gateway = start_gateway(config)
        await await_until(lambda a=a, b=b: [(f.stats()["kv_since"] or 0) for f in (a, b)] == [3, 4], "the kv events")
        async with aiohttp.ClientSession() as client:
            before = await served_by(client, gateway.url, {"model": "m", "prompt": prompt, "max_tokens": 1})
            b.control(load_report={**report, "kv_tiers": [{"medium": "disk", "restore_fraction": 0.02}]})

            async def reported(client=client, gateway=gateway, a=a, b=b) -> bool:
                async with client.get(gateway.url + "/status.json") as response:
                    rows = orjson.loads(await response.read())["endpoints"]
                return {e["id"]: e["kv_restore_fractions"] for e in rows} == {a.url: {}, b.url: {"disk": 0.02}}

            await await_until(reported, "b's restore cost to reach the gateway")
            after = await served_by(client, gateway.url, {"model": "m", "prompt": prompt, "max_tokens": 1})
        served[measured] = (before, after)
    assert served == {True: ("a", "b"), False: ("a", "a")}


async def test_a_shared_stores_blocks_count_at_every_worker_that_reads_it(start_fakes, start_gateway) -> None:
    """a wrote the prompt's 4 blocks to the store it shares with b, and is busy; c holds the first block on its
    device. b, whose /load names the same store, gets the request (4 blocks at the store's weight, 0.3 x 64 tokens,
    outweigh c's 16 on the device); the gateway credited a's store blocks to b. When b's /load names another
    store, c gets it."""
    prompt = list(range(4000, 4064))
    hashes = block_hashes(prompt, 16)
    idle = {"num_running": 0, "num_waiting": 0, "num_prefill_tokens_pending": 0, "num_decode_tokens_pending": 0,
            "num_free_blocks": 100, "num_total_blocks": 100, "num_cached_blocks": 0, "block_size": 16}
    busy = {**idle, "num_running": 8, "num_prefill_tokens_pending": 20000}

    def store(shared: str) -> list[dict]:
        return [{"medium": "store", "up": True, "shared": shared, "restore_fraction": None}]

    served = {}
    for b_store in ("s1", "s2"):
        a, b, c = start_fakes("a", "b", "c")
        a.control(kv_stored=hashes, kv_medium="store", load_report={**busy, "kv_tiers": store("s1")})
        b.control(load_report={**idle, "kv_tiers": store(b_store)})
        c.control(kv_stored=hashes[:1], load_report=idle)
        config = gateway_config({"p": [a.url, b.url, c.url]}, policy="prefix_aware")
        config["providers"]["p"].update(offers_kv_events=True, offers_load=True)
        gateway = start_gateway(config)
        await await_until(lambda a=a, c=c: [(f.stats()["kv_since"] or 0) for f in (a, c)] == [4, 1], "the kv events")
        async with aiohttp.ClientSession() as client:

            async def reported(client=client, gateway=gateway, a=a, b=b, c=c, b_store=b_store) -> bool:
                async with client.get(gateway.url + "/status.json") as response:
                    rows = orjson.loads(await response.read())["endpoints"]
                return {e["id"]: e["kv_store"] for e in rows} == {a.url: "s1", b.url: b_store, c.url: None}

            await await_until(reported, "the workers' stores to reach the gateway")
            served[b_store] = await served_by(client, gateway.url, {"model": "m", "prompt": prompt, "max_tokens": 1})
    assert served == {"s1": "b", "s2": "c"}
    assert metric(gateway, "switchyard_poll_failures_total", poller="load") == 0


async def test_a_malformed_kv_events_poll_is_a_warning_and_a_counted_failure(start_fakes, start_gateway) -> None:
    fake, = start_fakes("a")
    # The field names the gateway once expected, which no worker sends: every poll of them fails.
    fake.control(kv_events=[{"seq": 1, "type": "stored", "block_hash": 7, "parent_hash": None}])
    config = gateway_config({"p": [fake.url]}, policy="prefix_aware")
    config["providers"]["p"]["offers_kv_events"] = True
    gateway = start_gateway(config)
    failed = {"poller": "kv_events", "cause": "bad_response", "endpoint": fake.url}
    await await_until(lambda: metric(gateway, "switchyard_poll_failures_total", **failed) >= 3,
                      "three failed kv_events polls to be counted")
    warnings = [line for line in gateway.log().splitlines() if f"kv_events poll of {fake.url} failed" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "malformed KV event" in warnings[0], warnings


async def test_load_reports_steer_least_tokens(start_fakes, start_gateway) -> None:
    busy, idle = start_fakes("busy", "idle")
    report = {"num_running": 8, "num_waiting": 4, "num_prefill_tokens_pending": 50_000,
              "num_decode_tokens_pending": 9_000, "num_free_blocks": 10, "num_total_blocks": 1000,
              "num_cached_blocks": 0, "block_size": 16}
    busy.control(load_report=report)
    idle.control(load_report={**report, "num_running": 0, "num_waiting": 0, "num_prefill_tokens_pending": 0,
                              "num_decode_tokens_pending": 0, "num_free_blocks": 1000})
    config = gateway_config({"p": [busy.url, idle.url]}, policy="least_tokens")
    config["providers"]["p"]["offers_load"] = True
    gateway = start_gateway(config)
    await await_until(lambda: metric(gateway, "switchyard_inflight_tokens", endpoint=busy.url) == 59_000,
                      "the busy worker's load report to reach the gateway")
    async with aiohttp.ClientSession() as client:
        homes = [await served_by(client, gateway.url, {"model": "m", "prompt": "hi"}) for _ in range(6)]
    assert homes == ["idle"] * 6
