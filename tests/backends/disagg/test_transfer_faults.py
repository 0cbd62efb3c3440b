"""Disaggregated prefill/decode on real worker processes behind the real gateway (the workers:
conftest.py), when things go wrong: bad decode legs, holds no decode leg will claim, cut transfers, a client
gone during the pull, and killed workers leave clear errors or full answers and no held blocks.
The killed-worker tests change the cluster: they run last, in this file's order.
"""
from __future__ import annotations

import asyncio
import signal
from typing import Any

from tests.backends.pd_cluster import Cluster
from tests.backends.pd_http import assert_drained, get, holds_nothing, post, post_json, stream
from tests.backends.references import text_of
from tests.gateway.conftest import metric
from tests.support.wait import await_until

# --- refusals, holds and cut transfers ------------------------------------------------------------

async def test_bad_decode_legs_are_clear_errors_without_leaks(cluster: Cluster, references) -> None:
    body = references[1].body
    status, pre = await post(cluster.url("p1"),
                             {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    kv = pre["kv_transfer_params"]
    status, err = await post(cluster.url("d2"), {**body, "kv_transfer_params": {**kv, "num_prompt_tokens": 3}})
    assert status == 400 and err["error"]["code"] == "kv_transfer_mismatch"
    status, err = await post(cluster.url("d2"), {**body, "kv_transfer_params": {**kv, "remote_request_id": "nope"}})
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed"
    status, err = await post(cluster.url("d2"), {**body, "kv_transfer_params": {**kv, "remote_port": 1}})
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed"
    status, err = await post(cluster.url("d2"), {**body, "kv_transfer_params": {**kv, "first_token_ids": "x"}})
    assert status == 400 and err["error"]["param"] == "kv_transfer_params.first_token_ids"
    status, err = await post(cluster.url("d2"), {**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 400   # a decode-role worker has no KV listener to hold blocks for
    await assert_drained(cluster, ["p1", "d2"])   # includes the unclaimed hold expiring


async def test_a_decode_leg_refused_before_its_pull_releases_the_hold_at_once(cluster: Cluster, references) -> None:
    """min_tokens above max_tokens: the prefill leg, run with max_tokens 1, cannot tell, and the decode worker
    refuses the leg (400). No decode leg will ask for that hold, so the decode worker has the prefill worker
    release it then, rather than the prompt's blocks staying held until the hold expires."""
    body = references[1].body
    status, pre = await post(cluster.url("p1"),
                             {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    kv = pre["kv_transfer_params"]
    assert status == 200 and (await get(cluster.url("p1") + "/load"))["num_held_blocks"] > 0
    status, err = await post(cluster.url("d1"), {**body, "max_tokens": 4, "min_tokens": 10, "kv_transfer_params": kv})
    assert status == 400 and err["error"]["param"] == "min_tokens", err
    await await_until(lambda: holds_nothing(cluster.url("p1")), "P1's hold to be released", timeout_s=30)
    assert f"KV hold {kv['remote_request_id']} expired" not in cluster.workers["p1"].log()   # released, not expired
    await assert_drained(cluster, ["p1", "d1"])


async def test_the_gateway_can_release_a_hold_no_decode_leg_will_claim(cluster: Cluster, references) -> None:
    """POST /kv_holds/release (the gateway's call when it falls back, redoes the prefill or its client leaves):
    the blocks are freed at once, a second call finds nothing, and a decode worker holds nothing to release."""
    body = references[1].body
    status, pre = await post(cluster.url("p1"),
                             {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    transfer_id = pre["kv_transfer_params"]["remote_request_id"]
    assert status == 200 and (await get(cluster.url("p1") + "/load"))["num_held_blocks"] > 0
    for released in (True, False):
        assert await post_json(cluster.url("p1") + "/kv_holds/release", {"transfer_id": transfer_id}) == \
            (200, {"released": released})
    # the engine thread frees the blocks on its next step, woken by the release: awaited, not read at once
    await await_until(lambda: holds_nothing(cluster.url("p1")), "P1's hold to be freed", timeout_s=30)
    assert f"KV hold {transfer_id} expired" not in cluster.workers["p1"].log()   # released, not expired
    status, err = await post_json(cluster.url("d1") + "/kv_holds/release", {"transfer_id": transfer_id})
    assert status == 400 and err["error"]["param"] == "transfer_id", err
    status, err = await post_json(cluster.url("p1") + "/kv_holds/release", {"transfer_id": 7})
    assert status == 400 and err["error"]["param"] == "transfer_id", err
    await assert_drained(cluster, ["p1", "d1"])


async def test_transfer_cut_midway_fails_cleanly_and_hold_survives(cluster: Cluster, references) -> None:
    body = references[2].body
    status, pre = await post(cluster.url("p1"),
                             {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    kv = pre["kv_transfer_params"]
    upstream_port = kv["remote_port"]

    async def cut_proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        up_writer.write(await reader.read(65536))   # the PULL frame
        forwarded = 0
        while forwarded < 100_000:                   # BEGIN and ~4 of 30 layers, then the line goes dead
            data = await up_reader.read(65536)
            if not data:
                break
            writer.write(data[:100_000 - forwarded])
            forwarded += len(data)
        writer.transport.abort()
        up_writer.transport.abort()

    proxy = await asyncio.start_server(cut_proxy, "127.0.0.1", 0)
    proxy_port = proxy.sockets[0].getsockname()[1]
    try:
        status, err = await post(cluster.url("d3"), {**body, "kv_transfer_params": {**kv, "remote_port": proxy_port}})
    finally:
        proxy.close()
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed", err
    # No RELEASE was sent: the hold is still there and a retry straight from the listener succeeds.
    status, dec = await post(cluster.url("d3"), {**body, "kv_transfer_params": {**kv, "response_id": pre["id"]}})
    assert status == 200, dec
    references[2].check(kv["first_token_ids"] + dec["choices"][0]["token_ids"], None, "the retried pull")
    await assert_drained(cluster, ["p1", "d3"])


async def test_client_gone_during_the_pull_frees_the_blocks(cluster: Cluster, references) -> None:
    body = references[0].body
    _status, pre = await post(cluster.url("p1"),
                              {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    kv = pre["kv_transfer_params"]
    accepted, closed = asyncio.Event(), asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()           # accepts the pull and never answers: the decode worker waits ...
        await reader.read()      # ... until it closes the connection
        closed.set()

    proxy = await asyncio.start_server(silent, "127.0.0.1", 0)
    body2 = {**body, "kv_transfer_params": {**kv, "remote_port": proxy.sockets[0].getsockname()[1]}}
    try:
        request = asyncio.create_task(post(cluster.url("d3"), body2))
        await await_until(accepted.is_set, "the decode worker to start its pull")
        request.cancel()         # the client goes away mid-pull
        await asyncio.gather(request, return_exceptions=True)
        await await_until(closed.is_set, "the decode worker to give the pull up")

        async def freed() -> bool:
            load = await get(cluster.url("d3") + "/load")
            return load["num_waiting"] == 0 and load["num_free_blocks"] == load["num_total_blocks"]
        await await_until(freed, "the decode worker to free the leg's blocks")
    finally:
        proxy.close()
    # The handler's cancellation aborted the pull: a pull that ended otherwise (the 2 s idle timeout)
    # logs its failure before the blocks are freed.
    assert f"KV pull of {kv['remote_request_id']} from" not in cluster.workers["d3"].log_path.read_text()
    await assert_drained(cluster, ["p1", "d3"])


# --- killed workers (these change the cluster: keep them last, in this order) ---------------------

async def running_on(cluster: Cluster, names: list[str], key: str = "num_running") -> str:
    async def busy() -> str | None:
        for name in names:
            if (await get(cluster.url(name) + "/load"))[key] > 0:
                return name
        return None
    return await await_until(busy, f"{key} > 0 on one of {names}")


async def test_decode_killed_during_and_before_decode(cluster: Cluster, references) -> None:
    body = references[1].body
    long_body = {**body, "max_tokens": 150, "ignore_eos": True}
    status, ref = await post(cluster.url("p2"), long_body)
    # Non-streaming: the gateway retries the decode leg; the hold was already released by the first
    # pull, so that retry gets kv_transfer_failed and the request is redone from a new prefill.
    task = asyncio.create_task(post(cluster.gateway.url, long_body))
    victim = await running_on(cluster, ["d1", "d2", "d3"])
    cluster.kill(victim)
    status, payload = await task
    assert status == 200, payload
    # exact: the prompt has no full block (no prefix-cache hit anywhere) and the request runs alone on
    # each worker, so every step repeats p2's shapes through the same kernels (all --threads 1)
    assert payload["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    # Killed before decode: legs routed to the dead worker are retried on the live ones.
    for ref2 in references[:4]:
        status, payload = await post(cluster.gateway.url, ref2.body, ref2.chat)
        assert status == 200, payload
        ref2.check(payload["choices"][0]["token_ids"], text_of(payload["choices"][0]), "after a decode worker died")
    # Streaming: the client already has tokens (the prefill's and some of the decode's), so the answer goes
    # on from them on the last decode worker (mid-stream failover), as one stream.
    live = [n for n in ("d1", "d2", "d3") if n != victim]
    continued = metric(cluster.gateway, "switchyard_stream_failovers_total", outcome="continued")
    events: list[dict[str, Any]] = []
    task = asyncio.create_task(stream(cluster.gateway.url, long_body, events=events))
    await await_until(lambda: len([e for e in events if e.get("choices")]) >= 2,
                      "the client to have the prefill's token and one of the decode's")
    second = await running_on(cluster, live)
    num_before = len([e for e in events if e.get("choices")])
    cluster.kill(second)
    events = await task
    assert all("error" not in e for e in events), events[-1]
    assert {e["id"] for e in events} == {events[0]["id"]}
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert len(ids) == len(ref["choices"][0]["token_ids"]) == 150
    assert ids[:num_before] == ref["choices"][0]["token_ids"][:num_before]   # as exact as the run above
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert metric(cluster.gateway, "switchyard_stream_failovers_total", outcome="continued") == continued + 1
    cluster.workers["_dead"] = cluster.workers.pop(victim)
    cluster.workers["_dead2"] = cluster.workers.pop(second)


async def test_prefill_killed_after_prefill_is_redone(cluster: Cluster, references) -> None:
    ref = references[3]
    body, chat = ref.body, ref.chat
    decode = next(n for n in ("d1", "d2", "d3") if n in cluster.workers)
    redos = metric(cluster.gateway, "switchyard_pd_redos_total", code="kv_transfer_failed")
    cluster.kill(decode, signal.SIGSTOP)   # the decode leg waits while we kill the prefill holding the KV
    try:
        task = asyncio.create_task(post(cluster.gateway.url, body, chat))
        holder = await running_on(cluster, ["p1", "p2"], key="num_held_blocks")
        cluster.kill(holder)
        cluster.workers["_dead3"] = cluster.workers.pop(holder)
    finally:
        cluster.kill(decode, signal.SIGCONT)
    status, payload = await task
    assert status == 200, payload   # pull failed -> kv_transfer_failed -> redo on the other prefill worker
    assert metric(cluster.gateway, "switchyard_pd_redos_total", code="kv_transfer_failed") == redos + 1
    ref.check(payload["choices"][0]["token_ids"], text_of(payload["choices"][0]), "redone after the prefill died")
    # Survivors keep serving, and hold nothing.
    survivor = next(n for n in ("p1", "p2") if n in cluster.workers)
    status, payload = await post(cluster.gateway.url, body, chat)
    assert status == 200, payload
    ref.check(payload["choices"][0]["token_ids"], text_of(payload["choices"][0]), "served by the survivors")
    await assert_drained(cluster, [survivor, decode])
