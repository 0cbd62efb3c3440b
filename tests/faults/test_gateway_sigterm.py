"""The gateway SIGTERMed under load (issue 11 §2, scenario 5), what tests/gateway/test_drain.py leaves out:
streams already mid-answer when the signal comes, a burst of concurrent new requests during the drain (each
an OpenAI-style 503, none reaching the upstream), every request accounted for at the upstream by its id,
and, as gateway/server/middlewares.py promises, the listener open until the last request ended, closed after the exit.
"""
from __future__ import annotations

import asyncio
import signal
from functools import partial

import aiohttp
import pytest

from tests.faults.client import (
    CLIENT_TIMEOUT,
    Reply,
    assert_openai_error,
    assert_whole_answer,
    chat,
    new_request_id,
    post,
)
from tests.faults.conftest import Processes
from tests.gateway.conftest import gateway_config
from tests.support.fake_faults import words
from tests.support.wait import await_until

NUM_CHUNKS = 4
NUM_MID_STREAM = 3      # streams that have their first event when SIGTERM comes
NUM_BEFORE_FIRST = 4    # requests (2 streamed, 2 whole) still waiting for their first byte
NUM_REFUSED = 16        # new requests during the drain
DRAIN_TIMEOUT_S = 120.0  # bounds a broken run only: the drain ends when the last held request does


async def _held(url: str, stream: bool, gate: dict[str, str], first_events: list[bytes]) -> tuple[str, Reply]:
    """A request the fake holds at `gate`; a stream's first event goes to `first_events` as it arrives."""
    request_id = new_request_id()
    body = chat("m", stream, fake={"chunks": NUM_CHUNKS, **gate})
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client, \
            client.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": request_id}) as response:
        received = b""
        if stream:
            while b"\n\n" not in received and (chunk := await response.content.readany()):
                received += chunk
            first_events.append(received)
        received += await response.read()
        return request_id, Reply(response.status, dict(response.headers), received)


async def _is_draining(url: str) -> bool:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client, client.get(url + "/ready") as response:
        return response.status == 503 and (await response.json())["status"] == "draining"


async def test_sigterm_under_load_finishes_streams_refuses_new_ones_and_exits_zero(procs: Processes) -> None:
    (fake,) = procs.fakes("a")
    gateway = procs.gateway(gateway_config({"p": [fake.url]}, drain_timeout_s=DRAIN_TIMEOUT_S))
    first_events: list[bytes] = []
    mid = [asyncio.create_task(_held(gateway.url, True, {"chunk_gate": "mid"}, first_events))
           for _ in range(NUM_MID_STREAM)]
    before = [asyncio.create_task(_held(gateway.url, i % 2 == 0, {"first_chunk_gate": "first"}, []))
              for i in range(NUM_BEFORE_FIRST)]
    await await_until(lambda: fake.num_waiting("mid") == NUM_MID_STREAM and len(first_events) == NUM_MID_STREAM
                      and fake.num_waiting("first") == NUM_BEFORE_FIRST, "every request held upstream")

    gateway.send_signal(signal.SIGTERM)
    await await_until(partial(_is_draining, gateway.url), "/ready to report the drain")
    refused = await asyncio.gather(*(post(gateway.url, chat("m", i % 2 == 0), headers={"x-request-id": f"new-{i}"})
                                     for i in range(NUM_REFUSED)))
    for reply in refused:
        error = assert_openai_error(reply, 503, "shutting_down")
        assert reply.headers["Retry-After"] == "1" and error["type"] == "server_error"
    assert gateway.alive and not any(task.done() for task in mid + before)   # still serving what it had
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client, client.get(gateway.url + "/health") as health:
        assert health.status == 200   # probes are still answered while draining

    fake.release("mid", NUM_MID_STREAM * (NUM_CHUNKS - 1))
    fake.release("first", NUM_BEFORE_FIRST)
    results = await asyncio.gather(*mid, *before)   # raises if any connection was reset
    for i, (_, reply) in enumerate(results):
        assert_whole_answer(reply, words(NUM_CHUNKS), stream=i < NUM_MID_STREAM or (i - NUM_MID_STREAM) % 2 == 0)
    assert gateway.wait_exit() == 0
    with pytest.raises(aiohttp.ClientConnectorError):   # the listener closed with the process
        await post(gateway.url, chat("m", False))
    # Each held request ran once upstream; none of the refused ones got there.
    assert sorted(fake.stats()["request_ids"]) == sorted(request_id for request_id, _ in results)
    assert fake.alive

