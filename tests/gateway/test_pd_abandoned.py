"""What the disaggregated provider gives up: a prefill's held KV that no decode leg will claim is released on
the prefill worker at once (the request falls back to another provider, is redone from a new prefill, runs out
of retries, or its client leaves); what a prefill leg cannot serve (n > 1, a batch of prompts) runs whole on a
decode worker."""
from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.gateway.test_pd import BODY, COMPLETIONS, Pd, post, wait_idle
from tests.support.fake_upstream import FakeUpstream
from tests.support.wait import await_until


async def released(prefill: FakeUpstream, transfer_ids: list[str]) -> None:
    """The gateway asked `prefill` to release these holds, and it holds nothing."""
    await await_until(lambda: prefill.stats()["released"] == transfer_ids and not prefill.stats()["held"],
                      f"{transfer_ids} to be released", timeout_s=10)


async def test_a_hold_is_released_when_the_decode_pool_gives_out_and_the_request_falls_back(tmp_path: Path) -> None:
    pair = Pd(tmp_path, ["p1"], ["d1"], both=("u1",))
    try:
        pair.decode[0].control(behaviour={"status": 502})
        status, answer = await post(pair.gateway.url, BODY)
        assert status == 200 and answer["served_by"] == "u1", answer
        await released(pair.prefill[0], ["xfer-p1-1"])   # it would have been held until it expired
    finally:
        pair.stop()


async def test_a_hold_whose_pull_broke_is_released_before_the_redo(tmp_path: Path) -> None:
    pair = Pd(tmp_path, ["p1"], ["d1"])
    try:
        pair.decode[0].control(behaviour={"status": 503, "code": "kv_transfer_failed"}, times=1)
        status, answer = await post(pair.gateway.url, BODY)
        assert status == 200 and answer["choices"][0]["message"]["content"] == "first tok1 tok2 tok3 ", answer
        await released(pair.prefill[0], ["xfer-p1-1"])   # the redo's own hold, xfer-p1-2, was claimed
    finally:
        pair.stop()


async def test_a_hold_is_released_when_the_client_leaves_before_the_decode_leg_claims_it(tmp_path: Path) -> None:
    pair = Pd(tmp_path, ["p1"], ["d1"])
    try:
        body = {**BODY, "stream": True, "fake": {"decode": {"stall_gate": "before-claim"}}}
        async with aiohttp.ClientSession() as client, client.post(pair.gateway.url + "/v1/chat/completions",
                                                                  json=body) as response:
            assert response.status == 200
            assert b"first" in await response.content.readuntil(b"\n\n")   # the prefill's token, then leave
            await await_until(lambda: pair.decode[0].num_waiting("before-claim") == 1, "the decode leg to wait")
        await released(pair.prefill[0], ["xfer-p1-1"])
        pair.decode[0].control(release={"before-claim": 1})
    finally:
        pair.stop()


async def test_a_hold_is_released_when_the_retries_run_out(tmp_path: Path) -> None:
    """Two attempts allowed, and both decode legs fail with a decode worker left untried: the request ends
    (502) while the run still holds the prefill, which the dispatcher's give-up lets go."""
    pair = Pd(tmp_path, ["p1"], ["d1", "d2", "d3"], max_attempts=2)
    try:
        for decode in pair.decode:
            decode.control(behaviour={"status": 502})
        status, error = await post(pair.gateway.url, BODY)
        assert status == 502, error
        assert sum(d.stats()["num_requests"] for d in pair.decode) == 2
        await released(pair.prefill[0], ["xfer-p1-1"])
    finally:
        pair.stop()


async def test_a_claimed_hold_is_not_released(tmp_path: Path) -> None:
    """Once the decode leg has a token, its pull has released the hold: a client that leaves then asks nothing
    of the prefill worker. The release after it, of a request that does fall back, is the only one it sees."""
    pair = Pd(tmp_path, ["p1"], ["d1"], both=("u1",))
    try:
        # The decode leg streams one token, then is held mid-stream until the client has left.
        body = {**BODY, "stream": True, "max_tokens": 500, "fake": {"decode": {"chunks": 200, "chunk_gate": "mid"}}}
        async with aiohttp.ClientSession() as client, client.post(pair.gateway.url + "/v1/chat/completions",
                                                                  json=body) as response:
            assert b"first" in await response.content.readuntil(b"\n\n")
            assert b"tok1" in await response.content.readuntil(b"\n\n")   # the decode leg's first: then leave
            await await_until(lambda: pair.decode[0].num_waiting("mid") == 1, "the decode leg to be mid-stream")
        await wait_idle(pair.gateway, [pair.prefill[0].url, pair.decode[0].url])   # the gateway saw it go
        pair.decode[0].control(behaviour={"status": 502})
        status, answer = await post(pair.gateway.url, BODY)
        assert status == 200 and answer["served_by"] == "u1", answer
        await released(pair.prefill[0], ["xfer-p1-2"])
    finally:
        pair.stop()


async def test_n_choices_and_a_batch_of_prompts_run_whole_on_a_decode_worker(tmp_path: Path) -> None:
    """A prefill leg samples one sequence: n > 1 and a batch of prompts go to a decode worker whole (they were
    refused: with the PD provider alone, a 503 and then a 400)."""
    pd = Pd(tmp_path, ["p1"], ["d1"])
    try:
        status, answer = await post(pd.gateway.url, {**BODY, "n": 2})
        assert status == 200 and answer["served_by"] == "d1", answer
        status, answer = await post(pd.gateway.url, {**BODY, "prompt": ["a", "b"]}, path=COMPLETIONS)
        assert status == 200 and answer["served_by"] == "d1", answer
        assert pd.prefill[0].stats()["num_requests"] == 0 and pd.decode[0].stats()["num_requests"] == 2
    finally:
        pd.stop()


