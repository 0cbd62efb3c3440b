"""Mid-stream failover on real workers (bundled SmolLM2) behind the real gateway: the worker serving a
stream is SIGKILLed at a random token, again and again, and the client still gets one stream that equals
the uninterrupted answer, greedy and seeded, completions and chat, with its usage; no block is left in use.

Equal means token for token up to the first position where float32 rounding could decide the
uninterrupted answer's draw either way (tests/backends/numerics.py): the continuation recomputes the
output so far as a prompt, which rounds differently from decoding it step by step.
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import torch

from tests.backends.numerics import assert_mostly_clear, assert_same_text, first_unclear, logit_tolerance
from tests.backends.references import Reference, prompt_ids, reference_of, smollm2_vocabulary, text_of
from tests.gateway.conftest import metric
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import await_until
from tests.support.worker_proc import WorkerProcess

ARGS = ["--threads", "1", "--num-blocks", "64"]
NUM_KILLS = 8
REQUESTS: list[tuple[dict[str, Any], bool]] = [
    ({"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}, False),
    ({"prompt": "List three colors:", "max_tokens": 32, "temperature": 0.9, "seed": 11, "ignore_eos": True,
      "logprobs": 1}, False),
    ({"messages": [{"role": "user", "content": "Say hello to a friend in one sentence."}], "max_tokens": 32,
      "temperature": 0.0, "ignore_eos": True}, True),
    ({"messages": [{"role": "user", "content": "What is two plus two? Explain briefly."}], "max_tokens": 32,
      "temperature": 0.7, "seed": 3, "ignore_eos": True, "logprobs": True}, True),
]


class Fleet:
    """Workers A and B behind one gateway; a killed worker comes back on its port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.workers = [WorkerProcess(ARGS, log_dir=workdir, wait=False) for _ in range(2)]
        for worker in self.workers:
            worker.wait_healthy()
        config = {
            "models": {"smollm2": {"providers": ["local"], "policy": {"name": "round_robin"}}},
            "providers": {"local": {"kind": "openai", "endpoints": [w.url for w in self.workers],
                                    "offers_token_ids": True, "offers_load": True,
                                    "timeouts": {"connect_s": 2.0, "first_byte_s": 120.0, "total_s": 300.0}}},
            "pollers": {"health_interval_s": 0.2, "load_interval_s": 0.2},
            "retries": {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "budget_min_retries": 1000},
            "breaker": {"failure_threshold": 1000},
            "log_level": "WARNING",
        }
        self.gateway = GatewayProcess(config, workdir)

    async def serving(self) -> WorkerProcess:
        """The worker running a sequence now (requests go one at a time)."""
        async def find() -> WorkerProcess | None:
            for worker in self.workers:
                if worker.alive and (await get(worker.url + "/load"))["num_running"] > 0:
                    return worker
            return None
        found: list[WorkerProcess] = []

        async def one_running() -> bool:
            worker = await find()
            if worker is not None:
                found.append(worker)
            return worker is not None
        await await_until(one_running, "a worker to run the stream")
        return found[-1]

    async def restart(self, worker: WorkerProcess) -> None:
        """The killed worker back on its port, and healthy in the gateway's view too: a stream whose worker is
        killed before the gateway's health poll saw the other one come back would find nowhere to go on."""
        worker.wait_exit()
        index = self.workers.index(worker)
        self.workers[index] = WorkerProcess(ARGS, log_dir=self.workdir, port=worker.port)

        async def all_healthy() -> bool:
            endpoints = (await get(self.gateway.url + "/status.json"))["endpoints"]
            return len(endpoints) == len(self.workers) and all(e["healthy"] for e in endpoints)
        await await_until(all_healthy, "the gateway to see both workers healthy")

    def stop(self) -> None:
        self.gateway.stop()
        for worker in self.workers:
            worker.stop()


async def get(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return orjson.loads(await response.read())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("failover"))
    try:
        yield fleet
    finally:
        fleet.stop()


# A Messages API request (POST /v1/messages); its reference is the worker's answer to the chat body the gateway
# translates it into (no `ignore_eos` there: the answer may end early, and is long enough for a kill in it).
MESSAGES = {"messages": [{"role": "user", "content": "Write two sentences about the sea."}], "max_tokens": 32,
            "temperature": 0.0}


class Referee:
    """Uninterrupted answers from worker A, with where float32 rounding could have drawn another token (judged
    on transformers' logits for the same tokens)."""

    def __init__(self, fleet: Fleet, hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module) -> None:
        self.fleet, self.hf, self.hf64 = fleet, hf_smollm2, hf_smollm2_f64
        self.tokenizer, self.eos = smollm2_vocabulary()

    async def reference(self, extra: dict[str, Any], chat: bool) -> tuple[Reference, int]:
        """The answer to `extra` as a Reference, and its prompt's length."""
        body = {"model": "smollm2", "return_token_ids": True, **extra}
        payload = await self._answer(body, chat)
        prompt = prompt_ids(self.tokenizer, body, chat)
        tolerance = logit_tolerance(self.hf, self.hf64, [prompt + payload["choices"][0]["token_ids"]])
        assert payload["usage"]["prompt_tokens"] == len(prompt)
        return reference_of(body, chat, payload, prompt, self.hf, self.eos, tolerance), len(prompt)

    async def _answer(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with aiohttp.ClientSession() as session, \
                session.post(self.fleet.workers[0].url + path, json=body) as r:
            assert r.status == 200, await r.text()
            return orjson.loads(await r.read())


@pytest.fixture(scope="module")
def referee(fleet: Fleet, hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module) -> Referee:
    return Referee(fleet, hf_smollm2, hf_smollm2_f64)


@pytest.fixture(scope="module")
def references(referee: Referee) -> list[tuple[Reference, int]]:
    async def all_of_them() -> list[tuple[Reference, int]]:
        return [await referee.reference(extra, chat) for extra, chat in REQUESTS]
    refs = asyncio.run(all_of_them())
    for ref, _ in refs:
        assert len(ref.ids) == ref.body["max_tokens"]      # a kill anywhere in it is mid-stream
    assert_mostly_clear([r.choices for r, _ in refs], "the uninterrupted answers")
    return refs


async def test_sigkill_at_a_random_token_many_times(fleet: Fleet, references: list[tuple[Reference, int]]) -> None:
    rng = random.Random(20261124)
    num_whole = 0
    for i in range(NUM_KILLS):
        ref, num_prompt_tokens = references[i % len(references)]
        kill_after = rng.randrange(1, len(ref.ids) - 4)    # content events received before the kill
        path = "/v1/chat/completions" if ref.chat else "/v1/completions"
        body = {**ref.body, "stream": True, "stream_options": {"include_usage": True}}
        payloads: list[dict[str, Any]] = []
        killed: WorkerProcess | None = None
        async with aiohttp.ClientSession() as session, session.post(fleet.gateway.url + path, json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                payloads.append(orjson.loads(line[6:]))
                if killed is None and sum(1 for p in payloads if p.get("choices")) == kill_after:
                    killed = await fleet.serving()
                    killed.send_signal(signal.SIGKILL)
        assert killed is not None, f"request {i}: the stream ended before {kill_after} events"
        assert all("error" not in p for p in payloads), payloads[-1]
        assert {p["id"] for p in payloads} == {payloads[0]["id"]}, "one stream, one id"
        chosen = [c for p in payloads for c in p["choices"]]
        if ref.chat:
            assert [c for c in chosen if "role" in c["delta"]] == chosen[:1], "the role is sent once"
        ids = [t for c in chosen for t in c.get("token_ids", [])]
        if "logprobs" in ref.body:   # one entry per token across the kill; completions' offsets count on
            logprobs = [c["logprobs"] for c in chosen if c.get("logprobs")]
            tokens = [e["token"] for lp in logprobs for e in lp["content"]] if ref.chat else \
                [t for lp in logprobs for t in lp["tokens"]]
            assert len(tokens) == len(ids), f"request {i}: {len(tokens)} logprobs for {len(ids)} tokens"
            if not ref.chat:
                assert [o for lp in logprobs for o in lp["text_offset"]] == \
                    [len("".join(tokens[:k])) for k in range(len(tokens))], f"request {i}"
        if ref.check(ids, "".join(text_of(c) for c in chosen), f"request {i} killed after {kill_after} events"):
            num_whole += 1
            usage = payloads[-1]["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (num_prompt_tokens, len(ref.ids))
        await fleet.restart(killed)
    assert num_whole >= NUM_KILLS // 2, f"only {num_whole} answers could be compared whole"
    assert metric(fleet.gateway, "switchyard_stream_failovers_total", outcome="continued") == NUM_KILLS
    assert metric(fleet.gateway, "switchyard_stream_errors_total") == 0

    async def nothing_in_use() -> bool:
        loads = [await get(w.url + "/load") for w in fleet.workers]
        return all(load["num_running"] == 0 and load["num_free_blocks"] == load["num_total_blocks"]
                   for load in loads)
    await await_until(nothing_in_use, "both workers to hold no blocks")


async def killed_mid_stream(fleet: Fleet, path: str, body: dict[str, Any], text_event: str, kill_after: int,
                            headers: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], WorkerProcess]:
    """A stream of named events (`type` in each payload) whose worker is SIGKILLed once `kill_after` text events
    (`text_event`) came: every payload, and the worker killed."""
    payloads: list[dict[str, Any]] = []
    killed: WorkerProcess | None = None
    async with aiohttp.ClientSession() as session, session.post(fleet.gateway.url + path, json=body,
                                                                headers=headers) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            payloads.append(orjson.loads(line[6:]))
            if killed is None and sum(p["type"] == text_event for p in payloads) == kill_after:
                killed = await fleet.serving()
                killed.send_signal(signal.SIGKILL)
    assert killed is not None, f"the stream ended before {kill_after} text deltas"
    return payloads, killed


async def test_sigkill_mid_stream_on_the_messages_api(fleet: Fleet, referee: Referee) -> None:
    """POST /v1/messages: the gateway relays the worker's OpenAI stream re-encoded as Anthropic events; killed
    mid-stream, it goes on on the other worker inside the same message, with the uninterrupted answer's text."""
    ref, _ = await referee.reference(MESSAGES, chat=True)
    kill_after = 4
    assert len(ref.ids) >= kill_after + 4, f"the reference answer is too short to kill mid-stream: {ref.text!r}"
    continued_before = metric(fleet.gateway, "switchyard_stream_failovers_total", outcome="continued")
    body = {"model": "smollm2", **MESSAGES, "stream": True}
    payloads, killed = await killed_mid_stream(fleet, "/v1/messages", body, "content_block_delta", kill_after,
                                               headers={"anthropic-version": "2023-06-01"})
    kinds = [p["type"] for p in payloads]
    assert "error" not in kinds, payloads[-1]
    assert kinds.count("message_start") == kinds.count("content_block_start") == 1, kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds
    text = "".join(p["delta"]["text"] for p in payloads if p["type"] == "content_block_delta")
    assert_same_text(text, ref.ids, ref.choices, referee.tokenizer.decode, "the messages stream killed mid-way")
    if first_unclear(ref.choices) >= len(ref.ids):   # the whole answer is the reference's: so is its usage
        usage = payloads[-2]["usage"]
        assert usage["output_tokens"] == len(ref.ids), usage
    assert metric(fleet.gateway, "switchyard_stream_failovers_total", outcome="continued") == continued_before + 1
    await fleet.restart(killed)


async def test_sigkill_mid_stream_on_the_responses_api(fleet: Fleet, referee: Referee) -> None:
    """POST /v1/responses: the same re-encoding path as /v1/messages, with the Responses stream's events; killed
    mid-stream, it goes on on the other worker inside the same response, with the uninterrupted answer's text."""
    ref, _ = await referee.reference(MESSAGES, chat=True)
    kill_after = 4
    assert len(ref.ids) >= kill_after + 4, f"the reference answer is too short to kill mid-stream: {ref.text!r}"
    continued_before = metric(fleet.gateway, "switchyard_stream_failovers_total", outcome="continued")
    body = {"model": "smollm2", "input": MESSAGES["messages"], "max_output_tokens": MESSAGES["max_tokens"],
            "temperature": MESSAGES["temperature"], "stream": True}
    payloads, killed = await killed_mid_stream(fleet, "/v1/responses", body, "response.output_text.delta", kill_after)
    kinds = [p["type"] for p in payloads]
    assert "response.failed" not in kinds, payloads[-1]
    assert kinds.count("response.created") == kinds.count("response.output_item.added") == 1, kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    text = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    assert payloads[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert_same_text(text, ref.ids, ref.choices, referee.tokenizer.decode, "the responses stream killed mid-way")
    assert metric(fleet.gateway, "switchyard_stream_failovers_total", outcome="continued") == continued_before + 1
    await fleet.restart(killed)


async def test_sigkill_mid_stream_in_json_mode(fleet: Fleet) -> None:
    """JSON mode across a failover: the worker that goes on resumes from the token ids already out, so its
    JSON recognizer starts after them, and the answer the client gets is still one JSON object (json.loads
    is the reference). The ask is one whose greedy object closes in about 30 tokens."""
    continued_before = metric(fleet.gateway, "switchyard_stream_failovers_total", outcome="continued")
    body = {"model": "smollm2", "input": "Give a JSON object with keys a, b and c.", "max_output_tokens": 160,
            "temperature": 0, "text": {"format": {"type": "json_object"}}, "stream": True}
    payloads, killed = await killed_mid_stream(fleet, "/v1/responses", body, "response.output_text.delta", 8)
    assert payloads[-1]["type"] == "response.completed", payloads[-1]
    text = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    assert isinstance(json.loads(text), dict), text
    assert metric(fleet.gateway, "switchyard_stream_failovers_total", outcome="continued") == continued_before + 1
    await fleet.restart(killed)
