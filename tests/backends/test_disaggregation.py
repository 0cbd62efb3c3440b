"""Disaggregated prefill/decode on real worker processes (bundled SmolLM2, fp32 CPU) behind the real
gateway: outputs equal a unified worker's token for token, the KV arrives byte for byte, and killed
workers, cut transfers and unclaimed holds leave clear errors or full answers and no held blocks.

Token for token means: up to the first position where float32 rounding could decide the unified
worker's draw either way (tests/backends/numerics.py). Legs batched with other requests, or computed
beside prefix-cache hits, round differently from the unified run; nothing makes them bit-identical.

One module-scoped set of workers (tests/backends/pd_cluster.py): P1 (prefill), P2 (both: the unified
reference, also in the prefill pool), D1-D3 (decode). Prefill caches live in shared memory: D1 and D2
copy from them, D3 (started with --no-kv-shared-memory) pulls over TCP, so both transports are checked.
The failure tests kill workers, so they run last, in file order.
"""
from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.backends.numerics import logit_tolerance, teacher_forced_logits
from tests.backends.pd_cluster import Cluster
from tests.backends.pd_http import assert_idle, get, holds_nothing, post, post_json, stream
from tests.backends.pd_references import CHATS, PROMPTS, unified_references
from tests.backends.references import Reference, prompt_ids, smollm2_vocabulary, text_of
from tests.gateway.conftest import metric
from tests.support.wait import await_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("pd-workers"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def references(cluster: Cluster, hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module) -> list[Reference]:
    return unified_references(cluster.url("p2"), hf_smollm2, hf_smollm2_f64)


async def assert_drained(cluster: Cluster, names: list[str]) -> None:
    await assert_idle([cluster.url(name) for name in names])


# --- equivalence ----------------------------------------------------------------------------------

async def test_direct_legs_equal_unified_and_kv_is_byte_identical(cluster: Cluster, references) -> None:
    for ref in references:
        body, chat = ref.body, ref.chat
        status, pre = await post(cluster.url("p1"), {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, chat)
        assert status == 200, pre
        kv = pre["kv_transfer_params"]
        assert kv["remote_request_id"] == pre["id"]
        held = (await get(f"{cluster.url('p1')}/debug/kv_digest?transfer_id={kv['remote_request_id']}"))["held"]
        assert len(held) == len(kv["remote_block_ids"]) == -(-kv["num_prompt_tokens"] // 16)
        status, dec = await post(cluster.url("d1"), {**body, "kv_transfer_params": {**kv, "response_id": pre["id"]}}, chat)
        assert status == 200, dec
        assert dec["id"] == pre["id"]
        ids = kv["first_token_ids"] + dec["choices"][0]["token_ids"]
        if ref.check(ids, text_of(pre["choices"][0]) + text_of(dec["choices"][0]), "direct legs over shared memory"):
            assert dec["usage"]["completion_tokens"] == len(ref.ids)
        received = (await get(f"{cluster.url('d1')}/debug/kv_digest?transfer_id={kv['remote_request_id']}"))["received"]
        assert received["digests"] == held[received["start_block"]:]   # exact: the pull copies bytes
        # The same over TCP: D3 does not use shared memory.
        status, pre = await post(cluster.url("p1"), {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, chat)
        kv = pre["kv_transfer_params"]
        held = (await get(f"{cluster.url('p1')}/debug/kv_digest?transfer_id={kv['remote_request_id']}"))["held"]
        status, dec = await post(cluster.url("d3"), {**body, "kv_transfer_params": {**kv, "response_id": pre["id"]}}, chat)
        assert status == 200, dec
        ref.check(kv["first_token_ids"] + dec["choices"][0]["token_ids"], None, "direct legs over TCP")
        received = (await get(f"{cluster.url('d3')}/debug/kv_digest?transfer_id={kv['remote_request_id']}"))["received"]
        assert received["digests"] == held[received["start_block"]:]   # exact: the pull copies bytes
    totals = {name: (await get(f"{cluster.url(name)}/debug/kv_digest?transfer_id=-"))["totals"] for name in ("d1", "d3")}
    assert totals["d1"]["pulls"] > 0 and totals["d1"]["shared_memory_pulls"] == totals["d1"]["pulls"], totals
    assert totals["d3"]["pulls"] > 0 and totals["d3"]["shared_memory_pulls"] == 0, totals
    # The repeated prompts hit the decode worker's prefix cache: later pulls skip those blocks.
    await assert_drained(cluster, ["p1", "d1"])


async def test_speculative_decode_leg_equals_unified(cluster: Cluster, references) -> None:
    before = await get(f"{cluster.url('d2')}/load")
    for ref in references:
        status, pre = await post(cluster.url("p1"), {**ref.body, "max_tokens": 1,
                                                     "kv_transfer_params": {"do_remote_decode": True}}, ref.chat)
        assert status == 200, pre
        kv = pre["kv_transfer_params"]
        status, dec = await post(cluster.url("d2"), {**ref.body, "kv_transfer_params": {**kv, "response_id": pre["id"]}},
                                 ref.chat)
        assert status == 200, dec
        ids = kv["first_token_ids"] + dec["choices"][0]["token_ids"]
        ref.check(ids, text_of(pre["choices"][0]) + text_of(dec["choices"][0]), "decode leg with drafts")
    after = await get(f"{cluster.url('d2')}/load")
    assert after["num_spec_accepted_tokens"] > before["num_spec_accepted_tokens"], after
    await assert_drained(cluster, ["p1", "d2"])


async def test_gateway_equals_unified_alone_and_concurrent(cluster: Cluster, references) -> None:
    gw = cluster.gateway.url

    async def one(ref: Reference, streamed: bool) -> None:
        if streamed:
            events = await stream(gw, ref.body, ref.chat)
            assert {e["id"] for e in events} == {events[0]["id"]}
            choices = [e["choices"][0] for e in events if e.get("choices")]
            ref.check([t for c in choices for t in c.get("token_ids", [])], "".join(text_of(c) for c in choices),
                      "streamed through the gateway")
        else:
            status, payload = await post(gw, ref.body, ref.chat)
            assert status == 200, payload
            ids = payload["choices"][0]["token_ids"]   # first token (prefill) + the decode's
            if ref.check(ids, text_of(payload["choices"][0]), "through the gateway"):
                assert payload["usage"]["completion_tokens"] == len(ref.ids)

    for i, ref in enumerate(references[:4]):
        await one(ref, streamed=i % 2 == 1)
    jobs = [one(ref, streamed=k % 2 == 0) for k, ref in enumerate(references)]
    await asyncio.gather(*jobs[:8])
    await asyncio.gather(*jobs[8:])
    await assert_drained(cluster, ["p1", "p2", "d1", "d2", "d3"])


async def test_logprobs_cover_the_first_token_and_offsets_run_on(cluster: Cluster, hf_smollm2: torch.nn.Module,
                                                                hf_smollm2_f64: torch.nn.Module) -> None:
    """Logprobs through the gateway, whole and streamed, have one entry per output token, the prefill's first
    token included, each transformers' log-softmax for that token in that context; completions' text_offset
    counts on across the legs, and only the first chat chunk carries the role."""
    tokenizer, _ = smollm2_vocabulary()
    base = {"model": "smollm2", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    for chat, body in ((False, {**base, "prompt": PROMPTS[2], "logprobs": 2}),
                       (True, {**base, "messages": CHATS[0], "logprobs": True, "top_logprobs": 2})):
        prompt = prompt_ids(tokenizer, body, chat)
        status, whole = await post(cluster.gateway.url, body, chat)
        assert status == 200, whole
        events = await stream(cluster.gateway.url, body, chat)
        streamed = [e["choices"][0] for e in events if e.get("choices")]
        assert sum("role" in c.get("delta", {}) for c in streamed) == (1 if chat else 0)
        for choices in ([whole["choices"][0]], streamed):
            ids = [t for c in choices for t in c["token_ids"]]
            text = "".join(text_of(c) for c in choices)
            if chat:
                entries = [e for c in choices for e in c["logprobs"]["content"]]
                tokens, logprobs = [e["token"] for e in entries], [e["logprob"] for e in entries]
                assert all(len(e["top_logprobs"]) == 2 for e in entries)
                assert bytes(b for e in entries for b in e["bytes"]).decode() == text
            else:
                lists = {k: [v for c in choices for v in c["logprobs"][k]] for k in choices[0]["logprobs"]}
                tokens, logprobs = lists["tokens"], lists["token_logprobs"]
                assert lists["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
                assert all(len(top) == 2 for top in lists["top_logprobs"])
            assert len(ids) == len(tokens) == 6 and "".join(tokens) == text, (ids, tokens, text)
            reference = torch.log_softmax(teacher_forced_logits(hf_smollm2, prompt, ids), dim=-1)
            want = reference[torch.arange(len(ids)), torch.tensor(ids)].tolist()
            tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [prompt + ids])
            assert logprobs == pytest.approx(want, abs=2 * tolerance + 1e-5), (chat, ids)
    await assert_drained(cluster, ["p1", "p2"])


# --- refusals and cut transfers -------------------------------------------------------------------

async def test_stop_strings_across_the_leg_boundary(cluster: Cluster) -> None:
    """A stop string that begins in the prefill's token and ends in the decode leg's stops the answer
    where a unified worker stops it; text held back as a possible stop start is not lost."""
    base = {"model": "smollm2", "prompt": PROMPTS[0], "temperature": 0.0}
    _, one = await post(cluster.url("p2"), {**base, "max_tokens": 1})
    _, full = await post(cluster.url("p2"), {**base, "max_tokens": 10})
    # Exact comparisons below: prompt and answer fit in one block, so no worker ever has a prefix-cache
    # hit for them, and one request at a time runs alone: every worker repeats the unified worker's
    # step shapes through the same kernels on this machine (all --threads 1).
    assert full["usage"]["prompt_tokens"] + 10 < 16
    first, whole = text_of(one["choices"][0]), text_of(full["choices"][0])
    rest = whole[len(first):]
    assert whole.startswith(first) and len(first) >= 2 and len(rest) >= 2, (first, whole)
    spanning = first[-2:] + rest[:2]
    never = first[-1:] + "\x00never"
    assert 0 <= whole.find(spanning) < len(first)   # it really crosses the boundary
    for stop, finish in ((spanning, "stop"), (never, "length")):
        body = {**base, "max_tokens": 10, "stop": [stop]}
        status, ref = await post(cluster.url("p2"), body)
        assert status == 200 and ref["choices"][0]["finish_reason"] == finish
        ref_text = text_of(ref["choices"][0])
        status, got = await post(cluster.gateway.url, body)
        assert status == 200 and text_of(got["choices"][0]) == ref_text, (stop, got)
        assert got["choices"][0]["finish_reason"] == finish
        events = await stream(cluster.gateway.url, body)
        choices = [e["choices"][0] for e in events if e.get("choices")]
        assert "".join(text_of(c) for c in choices) == ref_text
        assert choices[-1]["finish_reason"] == finish
    # max_tokens 1: the prefill worker's answer is the whole answer, with nothing held back or held
    status, got = await post(cluster.gateway.url, {**base, "max_tokens": 1, "stop": [never]})
    assert status == 200 and text_of(got["choices"][0]) == first
    await assert_drained(cluster, ["p1", "p2"])


async def test_json_mode_holds_across_the_leg_boundary(cluster: Cluster) -> None:
    """The prefill worker's first token opens the object and the decode leg's recognizer goes on after it:
    the answer through the gateway is one JSON object (json.loads is the reference), whole and streamed."""
    finished = 0
    for ask in ("Give a JSON object with keys a, b and c.", "Return the capital of France as JSON.",
                "Describe a cat as JSON with its name and age."):
        body = {"model": "smollm2", "messages": [{"role": "user", "content": ask}], "max_tokens": 120,
                "temperature": 0.0, "response_format": {"type": "json_object"}}
        status, got = await post(cluster.gateway.url, body, chat=True)
        assert status == 200, got
        chunks = [e["choices"][0] for e in await stream(cluster.gateway.url, body, chat=True) if e.get("choices")]
        streamed = "".join(c["delta"].get("content") or "" for c in chunks)
        streamed_finish = next(c["finish_reason"] for c in chunks if c["finish_reason"])
        for text, finish in ((got["choices"][0]["message"]["content"], got["choices"][0]["finish_reason"]),
                             (streamed, streamed_finish)):
            assert text.startswith("{"), text
            if finish == "stop":
                assert isinstance(json.loads(text), dict), text
                finished += 1
    assert finished >= 2    # most close well inside max_tokens (greedy: the same answer whole and streamed)
    await assert_drained(cluster, ["p1", "p2"])


async def test_forced_tool_calls_run_whole_on_a_decode_worker(cluster: Cluster) -> None:
    """A worker answers a forced tool call's text as `tool_calls`, so it is not split into legs (a prefill leg
    refuses it): the gateway runs it whole on a decode worker. The calls name the tool and their arguments are
    JSON (json.loads is the reference), whole and streamed."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 60, "temperature": 0.0, "tools": [tool], "tool_choice": "required"}
    status, got = await post(cluster.gateway.url, body, chat=True)
    assert status == 200, got
    choice = got["choices"][0]
    assert choice["message"]["content"] is None and choice["finish_reason"] in ("tool_calls", "length"), choice
    calls = [c["function"] for c in choice["message"]["tool_calls"]]
    chunks = [e["choices"][0] for e in await stream(cluster.gateway.url, body, chat=True) if e.get("choices")]
    streamed: list[dict[str, str]] = []
    for piece in (p for c in chunks for p in c["delta"].get("tool_calls") or ()):
        if piece["index"] == len(streamed):
            streamed.append({"name": piece["function"]["name"], "arguments": ""})
        streamed[piece["index"]]["arguments"] += piece["function"]["arguments"]
    streamed_finish = next(c["finish_reason"] for c in chunks if c["finish_reason"])
    assert {c["name"] for c in calls + streamed} == {"get_weather"}, (calls, streamed)   # the one tool
    for answer, finish in ((calls, choice["finish_reason"]), (streamed, streamed_finish)):
        if finish == "tool_calls":   # ended by itself (not cut by max_tokens)
            assert all(isinstance(json.loads(c["arguments"]), dict) for c in answer), answer
    await assert_drained(cluster, ["p1", "p2"])


async def test_bad_decode_legs_are_clear_errors_without_leaks(cluster: Cluster, references) -> None:
    body = references[1].body
    status, pre = await post(cluster.url("p1"), {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
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
    status, pre = await post(cluster.url("p1"), {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
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
    status, pre = await post(cluster.url("p1"), {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
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
    status, pre = await post(cluster.url("p1"), {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
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
    status, pre = await post(cluster.url("p1"), {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
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
