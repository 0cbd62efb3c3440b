"""`n` > 1 choices and batches of prompts on a real worker (bundled SmolLM2, fp32 CPU): choice k of a seeded
request is the draw that seed + k gives on transformers' logits for the same tokens, whole and streamed,
completions and chat, each prompt of a batch in order; each prompt is counted once; bad combinations are 400s;
a client that leaves ends every choice's sequence."""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
import torch

from tests.backends.numerics import assert_same_tokens, choices, logit_tolerance, teacher_forced_logits
from tests.backends.references import prompt_ids, sampling_params, smollm2_vocabulary, text_of
from tests.backends.server.worker_client import num_generated, post, wait_idle, wait_running
from tests.support.worker_proc import WorkerProcess

pytestmark = pytest.mark.slow

SEED = 2026
BASE = {"model": "smollm2", "max_tokens": 8, "temperature": 0.8, "seed": SEED, "ignore_eos": True,
        "return_token_ids": True, "n": 3}
REQUESTS = [({**BASE, "prompt": "Once upon a time"}, False),
            ({**BASE, "messages": [{"role": "user", "content": "Name a fruit."}]}, True)]


@pytest.fixture(scope="module")
def worker_url() -> Iterator[str]:
    worker = WorkerProcess(["--threads", "2", "--num-blocks", "128"])
    try:
        yield worker.url
    finally:
        worker.stop()


def path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


async def streamed_choices(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[
        dict[int, list[dict[str, Any]]], dict[str, Any]]:
    """A stream's choice chunks by index, and its usage chunk."""
    by_index: dict[int, list[dict[str, Any]]] = {}
    usage: dict[str, Any] = {}
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = orjson.loads(line[6:])
                for choice in event["choices"]:
                    by_index.setdefault(choice["index"], []).append(choice)
                usage = event.get("usage") or usage
    return by_index, usage


async def test_each_choice_is_its_seeds_draw_whole_and_streamed(worker_url: str, hf_smollm2: torch.nn.Module,
                                                                hf_smollm2_f64: torch.nn.Module) -> None:
    tokenizer, eos = smollm2_vocabulary()
    async with aiohttp.ClientSession() as session:
        for body, chat in REQUESTS:
            prompt = prompt_ids(tokenizer, body, chat)
            status, whole = await post(session, worker_url + path(chat), body)
            assert status == 200, whole
            assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
            assert whole["usage"]["prompt_tokens"] == len(prompt)      # once, not n times
            assert whole["usage"]["completion_tokens"] == 3 * 8
            asks_usage = {"stream": True, "stream_options": {"include_usage": True}}
            streamed, usage = await streamed_choices(session, worker_url + path(chat), {**body, **asks_usage})
            assert sorted(streamed) == [0, 1, 2]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 3 * 8)
            answers = [c["token_ids"] for c in whole["choices"]]
            assert len({tuple(a) for a in answers}) > 1, "seed + k: the choices differ"
            tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [prompt + a for a in answers])
            for k, choice in enumerate(whole["choices"]):
                params = sampling_params({**body, "seed": SEED + k})
                reference = choices(teacher_forced_logits(hf_smollm2, prompt, choice["token_ids"]), params,
                                    params.seed, eos, tolerance, prompt)
                assert_same_tokens(choice["token_ids"], choice["token_ids"], reference, f"choice {k}")
                chunks = streamed[k]
                ids = [t for c in chunks for t in c["token_ids"]]
                if assert_same_tokens(ids, choice["token_ids"], reference, f"streamed choice {k}"):
                    assert "".join(text_of(c) for c in chunks) == text_of(choice)
                if chat:
                    assert [("role" in c["delta"]) for c in chunks] == [True] + [False] * (len(chunks) - 1)
                assert chunks[-1]["finish_reason"] == "length"
        await wait_idle(session, worker_url)


async def test_a_batch_of_prompts_answers_each_in_order(worker_url: str, hf_smollm2: torch.nn.Module,
                                                       hf_smollm2_f64: torch.nn.Module) -> None:
    """Prompt i's choice k is choice i * n + k, the draw seed + k gives for that prompt (as it would alone)."""
    tokenizer, eos = smollm2_vocabulary()
    texts = ["Once upon a time", "My favourite fruit is"]
    body = {**BASE, "n": 2, "prompt": [texts[0], tokenizer(texts[1])["input_ids"]]}   # text and token ids
    prompts = [prompt_ids(tokenizer, {"prompt": text}, False) for text in texts]
    async with aiohttp.ClientSession() as session:
        status, whole = await post(session, worker_url + "/v1/completions", body)
        assert status == 200, whole
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
        assert whole["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
        assert whole["usage"]["completion_tokens"] == 4 * 8
        answers = [c["token_ids"] for c in whole["choices"]]
        tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [prompts[j // 2] + a for j, a in enumerate(answers)])
        for j, answer in enumerate(answers):
            prompt, params = prompts[j // 2], sampling_params({**body, "seed": SEED + j % 2})
            reference = choices(teacher_forced_logits(hf_smollm2, prompt, answer), params, params.seed, eos,
                                tolerance, prompt)
            assert_same_tokens(answer, answer, reference, f"prompt {j // 2}, choice {j % 2}")
        streamed, _ = await streamed_choices(session, worker_url + "/v1/completions", {**body, "stream": True})
        assert sorted(streamed) == [0, 1, 2, 3]
        await wait_idle(session, worker_url)


async def test_the_other_choices_read_the_prompt_the_first_one_computed(worker_url: str) -> None:
    """A prompt's first choice prefills it alone; the others take every full block of it from the prefix cache
    (side by side, each computed the whole prompt again)."""
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 8   # new to the cache
    async with aiohttp.ClientSession() as session:
        async with session.get(worker_url + "/load") as resp:
            before = await resp.json()
        status, answer = await post(session, worker_url + "/v1/completions",
                                    {"prompt": prompt, "max_tokens": 2, "n": 3})
        assert status == 200, answer
        async with session.get(worker_url + "/load") as resp:
            after = await resp.json()
    # the blocks before the prompt's last token (that one is always computed, to sample from)
    num_full_blocks = (answer["usage"]["prompt_tokens"] - 1) // after["block_size"]
    assert num_full_blocks >= 4
    assert after["num_prompt_tokens"] - before["num_prompt_tokens"] == 3 * answer["usage"]["prompt_tokens"]
    read = after["num_cached_prompt_tokens"] - before["num_cached_prompt_tokens"]
    assert read == 2 * num_full_blocks * after["block_size"], (read, num_full_blocks)


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"n": 2, "resume_token_ids": [5]}, "resume_token_ids"),
    ({"n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n"),
    ({"n": 2, "max_tokens": 9000}, "max_tokens"),
    ({"prompt": ["Hi"] * 65}, "prompt"),
    ({"prompt": ["Hi"] * 8, "n": 9}, "prompt"),
    ({"prompt": ["Hi", ""]}, "prompt[1]"),
    ({"prompt": ["Hi", [1] * 2040]}, "max_tokens"),   # the worker's context: 2048 (128 blocks)
    ({"prompt": ["Hi", "Yo"], "resume_token_ids": [5]}, "resume_token_ids"),
    ({"prompt": ["Hi", "Yo"], "kv_transfer_params": {"do_remote_decode": True}}, "prompt"),
])
async def test_bad_choice_requests_are_400s(worker_url: str, extra: dict[str, Any], param: str) -> None:
    async with aiohttp.ClientSession() as session:
        status, error = await post(session, worker_url + "/v1/completions", {"prompt": "Hi", **extra})
        assert status == 400 and error["error"]["param"] == param, error
        await wait_idle(session, worker_url)


async def test_a_client_leaving_ends_every_choice(worker_url: str) -> None:
    body = {"prompt": "Count to a thousand:", "max_tokens": 600, "ignore_eos": True, "n": 3, "stream": True}
    async with aiohttp.ClientSession() as session:
        before = await num_generated(session, worker_url)
        async with session.post(worker_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()
            await wait_running(session, worker_url)
        # The response is closed: every sequence is aborted rather than run out to its 600 tokens.
        await wait_idle(session, worker_url)
        assert await num_generated(session, worker_url) - before < 3 * 600
        status, answer = await post(session, worker_url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and [c["index"] for c in answer["choices"]] == [0]


async def test_resumed_choices_go_on_from_their_own_tokens(worker_url: str) -> None:
    """`resume_token_ids` of each choice (the gateway's mid-stream failover): a choice goes on after its own
    tokens, one with none starts afresh, one the client has whole (null) does not run; usage counts each prompt
    and the output of the choices that ran."""
    body = {**BASE, "prompt": ["Once upon a time", "The sea is"], "n": 2, "seed": None, "temperature": 0.0}
    async with aiohttp.ClientSession() as session:
        status, whole = await post(session, worker_url + "/v1/completions", body)
        assert status == 200, whole
        ids = [c["token_ids"] for c in whole["choices"]]
        status, resumed = await post(session, worker_url + "/v1/completions",
                                     {**body, "resume_token_ids": [None, ids[1][:3], [], ids[3][:7]]})
        assert status == 200, resumed
        assert [c["index"] for c in resumed["choices"]] == [1, 2, 3]
        assert [c["token_ids"] for c in resumed["choices"]] == [ids[1][3:], ids[2], ids[3][7:]]
        assert resumed["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
        assert resumed["usage"]["completion_tokens"] == 3 * BASE["max_tokens"]
        await wait_idle(session, worker_url)
