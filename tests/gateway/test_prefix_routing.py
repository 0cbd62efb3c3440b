"""Prefix-aware routing in front of engines without our `/kv_events`: the approximate index (blocks the
gateway routed), the affinity key derived from a prompt's prefix, and vLLM-style KV events over a real
ZMQ socket (frames built as vLLM's publisher sends them). Real gateway processes, fake upstreams."""
from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import msgpack
import orjson
import zmq

from tests.gateway.conftest import gateway_config, metric
from tests.support.ports import free_port
from tests.support.wait import await_until

SYSTEM = list(range(1000, 1064))  # 4 blocks of 16 token ids every prompt below starts with


async def served_by(client: aiohttp.ClientSession, url: str, prompt: list[int]) -> str:
    async with client.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4}) as r:
        assert r.status == 200, await r.text()
        return orjson.loads(await r.read())["served_by"]


async def test_approximate_index_keeps_a_prefix_where_it_was_sent(start_fakes, start_gateway) -> None:
    fakes = start_fakes("a", "b", "c")
    gateway = start_gateway(gateway_config({"p": [f.url for f in fakes]}, policy="prefix_aware"))
    async with aiohttp.ClientSession() as client:
        conversations = [SYSTEM + list(range(k * 100, k * 100 + 48)) for k in range(6)]
        first = [await served_by(client, gateway.url, c) for c in conversations]
        again = [await served_by(client, gateway.url, c + list(range(5000, 5032))) for c in conversations]
    assert again == first  # each conversation's next turn went where its prefix was sent
    assert metric(gateway, "switchyard_routing_decisions_total", reason="prefix_hit") >= 6


async def test_headerless_requests_get_a_prefix_affinity_key(start_fakes, start_gateway) -> None:
    fakes = start_fakes("a", "b", "c", "d")
    config = gateway_config({"p": [f.url for f in fakes]}, policy="session_affinity")
    config["models"]["m"]["policy"]["options"] = {"prefix_key_tokens": 96}  # the first 6 blocks
    gateway = start_gateway(config)
    async with aiohttp.ClientSession() as client:
        homes = {}
        for k in range(8):
            head = SYSTEM + list(range(k * 100, k * 100 + 32))
            turns = [await served_by(client, gateway.url, head + list(range(7000 + t, 7016 + t)))
                     for t in range(3)]
            assert len(set(turns)) == 1, turns  # same first 96 tokens: same endpoint, every turn
            homes[k] = turns[0]
    assert len(set(homes.values())) > 1  # different prefixes spread over the ring
    assert metric(gateway, "switchyard_routing_decisions_total", reason="prefix_affinity") == 24


def vllm_frames(topic: bytes, seq: int, tokens: list[int], block_size: int = 16) -> list[bytes]:
    """One multipart message as vLLM's ZmqEventPublisher sends it: topic, 8-byte big-endian seq, and a
    msgpack EventBatch [ts, [BlockStored as a tagged map], dp rank] with vLLM's own (sha256) hashes."""
    hashes, parent = [], b""
    for start in range(0, len(tokens), block_size):
        parent = hashlib.sha256(parent + bytes(str(tokens[start:start + block_size]), "ascii")).digest()
        hashes.append(parent)
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
             "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}
    return [topic, seq.to_bytes(8, "big"), msgpack.packb([1.0, [event], 0], use_bin_type=True)]


async def test_vllm_kv_events_over_zmq_steer_routing(start_fakes, start_gateway) -> None:
    a, b, c = start_fakes("a", "b", "c")
    shared_port, own_port = free_port(), free_port()
    config = gateway_config({"p": [a.url, b.url, c.url]}, policy="prefix_aware")
    config["providers"]["p"]["kv_event_sources"] = {
        # vLLM connects to tcp://HOST:PORT, so the gateway binds it: two engines on one socket, by topic
        a.url: {"endpoint": f"tcp://127.0.0.1:{shared_port}", "topic": "engine-a"},
        b.url: {"endpoint": f"tcp://127.0.0.1:{shared_port}", "topic": "engine-b"},
        # vLLM binds tcp://*:PORT, so the gateway connects to it at the endpoint's host
        c.url: {"endpoint": f"tcp://*:{own_port}", "topic": ""},
    }
    gateway = start_gateway(config)
    prompt_b = SYSTEM + list(range(200, 264))
    prompt_c = SYSTEM + list(range(300, 364))
    context = zmq.Context()
    engines = context.socket(zmq.PUB)  # both engines' publishers, connected to the gateway's bound socket
    engines.connect(f"tcp://127.0.0.1:{shared_port}")
    engine_c = context.socket(zmq.PUB)
    engine_c.bind(f"tcp://127.0.0.1:{own_port}")
    seq = {"b": 0, "c": 0}
    try:
        async with aiohttp.ClientSession() as client:
            async def routed_by_events() -> bool:
                # PUB drops messages until the subscription has propagated: publish until they land
                engines.send_multipart(vllm_frames(b"engine-b", seq["b"], prompt_b))
                engine_c.send_multipart(vllm_frames(b"", seq["c"], prompt_c))
                seq["b"] += 1
                seq["c"] += 1
                hits = metric(gateway, "switchyard_routing_decisions_total", reason="prefix_hit")
                homes = (await served_by(client, gateway.url, prompt_b), await served_by(client, gateway.url, prompt_c))
                return homes == (b.name, c.name) and \
                    metric(gateway, "switchyard_routing_decisions_total", reason="prefix_hit") == hits + 2
            await await_until(routed_by_events, "the engines' KV events to steer routing", interval_s=0.05)
            homes_b = [await served_by(client, gateway.url, [*prompt_b, 9, 9, 9]) for _ in range(3)]
            homes_c = [await served_by(client, gateway.url, [*prompt_c, 9, 9, 9]) for _ in range(3)]
    finally:
        context.destroy(linger=0)
    assert homes_b == ["b"] * 3 and homes_c == ["c"] * 3
    assert metric(gateway, "switchyard_routing_decisions_total", reason="prefix_hit") >= 8
    # what reached the index, per engine: at most what was sent (PUB drops until the subscription is up)
    for fake, name in ((a, "a"), (b, "b"), (c, "c")):
        applied = metric(gateway, "switchyard_kv_event_batches_total", endpoint=fake.url)
        assert (applied == 0) if name == "a" else (1 <= applied <= seq[name]), (name, applied)


async def test_a_leases_prefill_work_is_what_the_endpoint_does_not_hold(start_fakes, start_gateway) -> None:
    """The in-flight prefill estimate of a request counts only the prompt tokens its endpoint must compute:
    a conversation's next turn, sent where its 7 first blocks are known to be, adds 2 blocks of work."""
    fakes = start_fakes("a", "b")
    gateway = start_gateway(gateway_config({"p": [f.url for f in fakes]}, policy="prefix_aware"))
    first = SYSTEM + list(range(48))                 # 112 tokens: 7 blocks of 16
    turn = first + list(range(500, 532))             # 144 tokens: 9 blocks, 7 of them sent before
    async with aiohttp.ClientSession() as client:
        home = await served_by(client, gateway.url, first)
        url = next(f.url for f in fakes if f.name == home)
        body = {"model": "m", "prompt": turn, "max_tokens": 4, "fake": {"first_chunk_gate": "hold"}}
        pending = asyncio.create_task(client.post(gateway.url + "/v1/completions", json=body))
        await await_until(lambda: metric(gateway, "switchyard_inflight_tokens", endpoint=url,
                                         phase="prefill") == len(turn) - len(first),
                          "the held turn's prefill work to be its 2 new blocks")
        next(f for f in fakes if f.name == home).release("hold")
        assert (await pending).status == 200
