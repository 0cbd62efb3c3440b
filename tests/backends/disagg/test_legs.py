"""Disaggregated prefill/decode on real worker processes (bundled SmolLM2, fp32 CPU) behind the real
gateway (the workers: conftest.py): outputs equal a unified worker's token for token, and the KV arrives
byte for byte; stop strings, JSON mode and forced tool calls hold across the leg boundary.

Token for token means: up to the first position where float32 rounding could decide the unified
worker's draw either way (tests/backends/numerics.py). Legs batched with other requests, or computed
beside prefix-cache hits, round differently from the unified run; nothing makes them bit-identical.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.backends.numerics import logit_tolerance, teacher_forced_logits
from tests.backends.pd_cluster import Cluster
from tests.backends.pd_http import assert_drained, get, post, stream
from tests.backends.pd_references import CHATS, PROMPTS
from tests.backends.references import Reference, prompt_ids, smollm2_vocabulary, text_of

# --- equivalence ----------------------------------------------------------------------------------

async def test_direct_legs_equal_unified_and_kv_is_byte_identical(cluster: Cluster, references) -> None:
    for ref in references:
        body, chat = ref.body, ref.chat
        status, pre = await post(cluster.url("p1"),
                                 {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, chat)
        assert status == 200, pre
        kv = pre["kv_transfer_params"]
        assert kv["remote_request_id"] == pre["id"]
        held = (await get(f"{cluster.url('p1')}/debug/kv_digest?transfer_id={kv['remote_request_id']}"))["held"]
        assert len(held) == len(kv["remote_block_ids"]) == -(-kv["num_prompt_tokens"] // 16)
        status, dec = await post(cluster.url("d1"), {**body, "kv_transfer_params": {**kv, "response_id": pre["id"]}},
                                 chat)
        assert status == 200, dec
        assert dec["id"] == pre["id"]
        ids = kv["first_token_ids"] + dec["choices"][0]["token_ids"]
        if ref.check(ids, text_of(pre["choices"][0]) + text_of(dec["choices"][0]), "direct legs over shared memory"):
            assert dec["usage"]["completion_tokens"] == len(ref.ids)
        received = (await get(f"{cluster.url('d1')}/debug/kv_digest?transfer_id={kv['remote_request_id']}"))["received"]
        assert received["digests"] == held[received["start_block"]:]   # exact: the pull copies bytes
        # The same over TCP: D3 does not use shared memory.
        status, pre = await post(cluster.url("p1"),
                                 {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, chat)
        kv = pre["kv_transfer_params"]
        held = (await get(f"{cluster.url('p1')}/debug/kv_digest?transfer_id={kv['remote_request_id']}"))["held"]
        status, dec = await post(cluster.url("d3"), {**body, "kv_transfer_params": {**kv, "response_id": pre["id"]}},
                                 chat)
        assert status == 200, dec
        ref.check(kv["first_token_ids"] + dec["choices"][0]["token_ids"], None, "direct legs over TCP")
        received = (await get(f"{cluster.url('d3')}/debug/kv_digest?transfer_id={kv['remote_request_id']}"))["received"]
        assert received["digests"] == held[received["start_block"]:]   # exact: the pull copies bytes
    totals = {name: (await get(f"{cluster.url(name)}/debug/kv_digest?transfer_id=-"))["totals"]
              for name in ("d1", "d3")}
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
        status, dec = await post(cluster.url("d2"),
                                 {**ref.body, "kv_transfer_params": {**kv, "response_id": pre["id"]}}, ref.chat)
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



# --- across the leg boundary ----------------------------------------------------------------------

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

