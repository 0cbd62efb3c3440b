"""The worker's HTTP API against one real worker process on the bundled model (fp32, CPU).

Greedy output is checked token for token against transformers' own `generate`, up to the first
position float32 rounding could decide either way (tests/backends/numerics.py); the rest checks the
OpenAI contract with the unmodified OpenAI SDK, error bodies, aborts and the ops endpoints.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from backends.core.sampling_params import SamplingParams
from tests.backends import numerics
from tests.backends.numerics import assert_same_text, assert_same_tokens, choices, first_unclear, teacher_forced_logits
from tests.backends.server import hf_greedy as hf_reference
from tests.backends.server.hf_greedy import GreedyReference, HFGreedy, assert_greedy_text, num_clear_greedy
from tests.backends.server.worker_client import num_generated, post, stream_text, wait_idle, wait_running, worker_metric
from tests.support.worker_proc import WorkerProcess, supervised

pytestmark = pytest.mark.slow

MODEL = "smollm2"
PROMPT_LEN = 16          # every reference prompt is cut to this many tokens: HF batches them unpadded
NUM_NEW_TOKENS = 64
NUM_BLOCKS = 512
MAX_REQUEST_MB = 1
# Long enough for a 2000-token sequence that a stop or a disconnect failed to abort to run out (then
# the generated-token count shows it); a passing run is idle at once.
RUN_OUT_S = 300.0
EOS = (2,)               # SmolLM2's <|im_end|>, banned under ignore_eos
PROMPTS = [
    "The capital of France is a city known for its museums, its food and its long history of",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively with two",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old",
    "The three primary colors are red, yellow and blue. When you mix two of them together you",
    "To make a good cup of tea, first boil fresh water, then warm the pot, and after that you",
]


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    """The worker process, started but not yet waited for (it loads while the reference runs)."""
    args = ["--model", MODEL, "--max-num-seqs", "32", "--num-blocks", str(NUM_BLOCKS),
            "--max-request-mb", str(MAX_REQUEST_MB), "--threads", "2"]
    proc = WorkerProcess(args, wait=False)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def worker_url(worker: WorkerProcess, hf_greedy: list[GreedyReference]) -> Iterator[str]:
    with supervised(worker) as url:
        yield url


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    ids = [smollm2_tokenizer.encode(p)[:PROMPT_LEN] for p in PROMPTS]
    assert all(len(p) == PROMPT_LEN for p in ids)
    return ids


@pytest.fixture(scope="module")
def hf_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return hf_reference.hf_float32_model(request, MODEL)


@pytest.fixture(scope="module")
def hf_run(hf_model: torch.nn.Module, hf_smollm2_f64: torch.nn.Module, worker: WorkerProcess,
           prompt_ids: list[list[int]]) -> HFGreedy:
    """transformers' greedy references for the prompts (`worker` is requested so that it loads meanwhile)."""
    return hf_reference.hf_greedy_run(hf_model, hf_smollm2_f64, prompt_ids, NUM_NEW_TOKENS, EOS)


@pytest.fixture(scope="module")
def hf_greedy(hf_run: HFGreedy) -> list[GreedyReference]:
    return hf_run.references


@pytest.fixture(scope="module")
def tolerance(hf_run: HFGreedy) -> float:
    return hf_run.tolerance


async def greedy(session: aiohttp.ClientSession, url: str, ids: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": NUM_NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
    status, out = await post(session, f"{url}/v1/completions", body)
    assert status == 200, out
    return out


async def test_greedy_alone_matches_transformers(worker_url: str, prompt_ids: list[list[int]],
                                                 hf_greedy: list[GreedyReference], tolerance: float,
                                                 smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    async with aiohttp.ClientSession() as session:
        for i, (ids, ref) in enumerate(zip(prompt_ids, hf_greedy, strict=True)):
            out = await greedy(session, worker_url, ids)
            choice = out["choices"][0]
            same = assert_same_tokens(choice["token_ids"], ref.tokens, ref.choices, f"prompt {i}")
            assert_same_text(choice["text"], ref.tokens, ref.choices,
                             lambda t: smollm2_tokenizer.decode(t, skip_special_tokens=True), f"prompt {i}")
            assert choice["finish_reason"] == "length"
            # A logprob is a logit less the log-sum-exp of all: each moves by the tolerance at most.
            agreed = len(ref.tokens) if same else first_unclear(ref.choices)
            assert choice["logprobs"]["token_logprobs"][:agreed] == pytest.approx(ref.logprobs[:agreed],
                                                                                  abs=2 * tolerance)
            assert out["usage"]["prompt_tokens"] == PROMPT_LEN
            assert out["usage"]["completion_tokens"] == NUM_NEW_TOKENS


async def test_greedy_in_concurrent_batch_matches_transformers(
        worker_url: str, prompt_ids: list[list[int]], hf_greedy: list[GreedyReference]) -> None:
    picks = [i % len(prompt_ids) for i in range(16)]
    async with aiohttp.ClientSession() as session:
        outs = await asyncio.gather(*(greedy(session, worker_url, prompt_ids[i]) for i in picks))
        for i, out in zip(picks, outs, strict=True):
            assert_same_tokens(out["choices"][0]["token_ids"], hf_greedy[i].tokens, hf_greedy[i].choices, f"prompt {i}")
        await wait_idle(session, worker_url)


async def test_logit_bias_matches_transformers_sequence_bias(
        worker_url: str, prompt_ids: list[list[int]], hf_greedy: list[GreedyReference], hf_model: torch.nn.Module,
        tolerance: float) -> None:
    """OpenAI's logit_bias, greedy, against transformers' generate with the same biases as one-token
    `sequence_bias`: the unbiased greedy first token banned (-100), a token it never chose favoured (+4), under
    a repetition penalty (the bias comes first in both). The output must differ from the unbiased one."""
    ids, plain = prompt_ids[1], hf_greedy[1].tokens
    with torch.inference_mode():
        step0 = hf_model(torch.tensor([ids])).logits[0, -1]
    favoured = next(t for t in step0.topk(8).indices.tolist() if t not in plain and t not in EOS)
    bias = {plain[0]: -100.0, favoured: 4.0}
    penalty = 1.3
    default_eos = hf_model.generation_config.eos_token_id
    hf_model.generation_config.eos_token_id = None   # like ignore_eos
    try:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS // 2, do_sample=False,
                                    suppress_tokens=list(EOS), repetition_penalty=penalty, pad_token_id=0,
                                    sequence_bias={(t,): b for t, b in bias.items()})
    finally:
        hf_model.generation_config.eos_token_id = default_eos
    want = out[0, len(ids):].tolist()
    assert want[0] != plain[0] and want != plain[:len(want)]
    params = SamplingParams(max_tokens=len(want), temperature=0.0, ignore_eos=True, repetition_penalty=penalty,
                            logit_bias=tuple(bias.items()))
    reference = choices(teacher_forced_logits(hf_model, ids, want), params, None, EOS, tolerance, prompt=ids)
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": ids, "max_tokens": len(want), "temperature": 0, "ignore_eos": True,
                "repetition_penalty": penalty, "return_token_ids": True,
                "logit_bias": {str(t): b for t, b in bias.items()}}
        status, got = await post(session, f"{worker_url}/v1/completions", body)
    assert status == 200, got
    assert_same_tokens(got["choices"][0]["token_ids"], want, reference, "logit_bias")


async def test_seeded_sampling_same_alone_and_in_busy_batch(worker_url: str, prompt_ids: list[list[int]],
                                                            hf_model: torch.nn.Module, tolerance: float) -> None:
    def body(seed: int | None, prompt: list[int], temperature: float = 0.9) -> dict[str, Any]:
        return {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": temperature, "top_p": 0.95,
                "top_k": 50, "seed": seed, "ignore_eos": True, "return_token_ids": True}

    url = f"{worker_url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        _, alone = await post(session, url, body(1234, prompt_ids[2]))
        others = [post(session, url, body(None if i % 3 else 7 + i, prompt_ids[i % 5], 1.0 if i % 2 else 0))
                  for i in range(14)]
        (_, busy), (_, other_seed), *_ = await asyncio.gather(
            post(session, url, body(1234, prompt_ids[2])), post(session, url, body(1235, prompt_ids[2])), *others)
    tokens = alone["choices"][0]["token_ids"]
    assert len(tokens) == 32
    # The batch around it changes how its logits round, not its draws: compared where rounding cannot
    # decide, judged on transformers' logits for the same tokens (each run lies within the tolerance).
    params = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    logits = teacher_forced_logits(hf_model, prompt_ids[2], tokens)
    reference = choices(logits, params, params.seed, EOS, tolerance, prompt_ids[2])
    numerics.assert_mostly_clear([reference], "the seeded draws")
    assert_same_tokens(busy["choices"][0]["token_ids"], tokens, reference, "busy against alone")
    assert other_seed["choices"][0]["token_ids"] != tokens


def test_openai_sdk_chat_stream_and_completions(worker_url: str, tolerance: float,
                                                smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    client = openai.OpenAI(base_url=f"{worker_url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Name three fruits."}]
    rendered = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    num_prompt = len(smollm2_tokenizer(rendered, add_special_tokens=False).input_ids)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                          logprobs=True, top_logprobs=2)
    assert chat.object == "chat.completion" and chat.model == MODEL
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")
    usage = chat.usage
    assert usage.prompt_tokens == num_prompt
    assert 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    streamed_usage = chunks[-1].usage
    assert streamed_usage.prompt_tokens == usage.prompt_tokens
    assert streamed_usage.prompt_tokens_details.cached_tokens >= 16   # the same prompt again: prefix hit
    # The cache hit computes only the prompt's tail, so the logits may round differently: the answers
    # agree up to the first token whose margin over the runner-up rounding could close.
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    content = chat.choices[0].logprobs.content
    num_clear = num_clear_greedy([[t.logprob for t in c.top_logprobs] for c in content], tolerance)
    assert_greedy_text(text, chat.choices[0].message.content, [c.token for c in content], num_clear)
    if num_clear == len(content):
        assert chunks[-2].choices[0].finish_reason == chat.choices[0].finish_reason
        assert (streamed_usage.completion_tokens, streamed_usage.total_tokens) == (
            usage.completion_tokens, usage.total_tokens)

    completion = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 10
    assert completion.usage.prompt_tokens == len(smollm2_tokenizer("The sky is").input_ids)


def test_openai_sdk_cached_tokens_on_repeated_prompt(worker_url: str, tolerance: float) -> None:
    client = openai.OpenAI(base_url=f"{worker_url}/v1", api_key="x", max_retries=0)
    prompt = "Prefix caching test. " + " ".join(f"item {i} is {i * i};" for i in range(40))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens - cached <= 16   # everything but a partial last block is reused
    # computed from a cache hit, the logits may round differently: equal where rounding cannot decide
    lp = first.choices[0].logprobs
    num_clear = num_clear_greedy([list(top.values()) for top in lp.top_logprobs], tolerance)
    assert_greedy_text(second.choices[0].text, first.choices[0].text, lp.tokens, num_clear)


async def test_stop_string_cuts_text_and_aborts(worker_url: str, prompt_ids: list[list[int]],
                                                hf_greedy: list[GreedyReference],
                                                smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    # The stop must come where our tokens surely equal transformers': in a prefix no rounding decides.
    pick = max(range(len(hf_greedy)), key=lambda i: (first_unclear(hf_greedy[i].choices), i == 1))
    num_clear = first_unclear(hf_greedy[pick].choices)
    assert num_clear >= 16, [first_unclear(r.choices) for r in hf_greedy]
    ref_tokens = hf_greedy[pick].tokens[:num_clear]
    full = smollm2_tokenizer.decode(ref_tokens, skip_special_tokens=True)
    start = len(full) // 2
    stop = full[start:start + 5]       # a stop string from the middle, across token boundaries
    cut = full.find(stop)
    prefixes = (smollm2_tokenizer.decode(ref_tokens[:n], skip_special_tokens=True) for n in range(1, num_clear + 1))
    num_stop_tokens = 1 + next(i for i, text in enumerate(prefixes) if stop in text and not text.endswith("\ufffd"))
    # max_tokens far beyond the stop: unless the stop aborts the sequence, the worker stays busy for minutes.
    body = {"model": MODEL, "prompt": prompt_ids[pick], "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stop": [stop], "return_token_ids": True}
    async with aiohttp.ClientSession() as session:
        before = await num_generated(session, worker_url)
        status, out = await post(session, f"{worker_url}/v1/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (full[:cut], "stop", stop)
        assert_same_tokens(choice["token_ids"], ref_tokens[:num_stop_tokens],
                           hf_greedy[pick].choices[:num_stop_tokens], "up to the stop")   # every position clear
        assert out["usage"]["completion_tokens"] == num_stop_tokens
        # Aborted: the engine stopped sampling long before max_tokens.
        await wait_idle(session, worker_url, timeout_s=RUN_OUT_S)
        assert await num_generated(session, worker_url) - before < body["max_tokens"]
        before = await num_generated(session, worker_url)
        streamed = await stream_text(session, f"{worker_url}/v1/completions", {**body, "stream": True})
        assert streamed == (full[:cut], "stop")
        await wait_idle(session, worker_url, timeout_s=RUN_OUT_S)
        assert await num_generated(session, worker_url) - before < body["max_tokens"]


BAD_REQUESTS = [
    # (path, raw body or json body, status, param, code)
    ("/v1/completions", b'{"prompt": "hi",', 400, None, "invalid_json"),
    ("/v1/completions", [1, 2, 3], 400, None, None),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content", "invalid_value"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 2}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10**9]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (MAX_REQUEST_MB * 2**20 + 10) + b'"}', 413, None,
     "request_too_large"),
    ("/v1/nowhere", {"model": MODEL}, 404, None, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS)
async def test_bad_input_gets_openai_error_and_worker_still_serves(
        worker_url: str, path: str, body: Any, status: int, param: str | None, code: str | None) -> None:
    async with aiohttp.ClientSession() as session:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with session.post(f"{worker_url}{path}", **kwargs) as resp:
            assert resp.status == status
            assert resp.content_type == "application/json"
            error = (await resp.json())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and error["type"].endswith("_error")
        assert (error["param"], error["code"]) == (param, code)
        good, out = await post(session, f"{worker_url}/v1/completions",
                               {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert good == 200 and out["usage"]["completion_tokens"] >= 1
        await wait_idle(session, worker_url)


async def test_prompt_over_context_is_refused(worker_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{worker_url}/v1/models") as resp:
            max_model_len = (await resp.json())["data"][0]["max_model_len"]
        status, out = await post(session, f"{worker_url}/v1/completions",
                                 {"model": MODEL, "prompt": [7] * (max_model_len + 1), "max_tokens": 1})
        assert status == 400 and out["error"]["code"] == "context_length_exceeded"
        await wait_idle(session, worker_url)


async def test_client_disconnect_aborts_sequence(worker_url: str, prompt_ids: list[list[int]]) -> None:
    body = {"model": MODEL, "prompt": prompt_ids[0], "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    url = f"{worker_url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        before = await num_generated(session, worker_url)
        resp = await session.post(url, json={**body, "stream": True})
        assert resp.status == 200
        for _ in range(3):
            assert (await resp.content.readline()).startswith(b"data: ")
            await resp.content.readline()
        resp.close()                                 # mid-stream disconnect
        await wait_idle(session, worker_url, timeout_s=RUN_OUT_S)
        assert await num_generated(session, worker_url) - before < body["max_tokens"]   # aborted, not finished
        before = await num_generated(session, worker_url)

        pending = asyncio.ensure_future(session.post(url, json=body))   # non-streaming, then disconnect
        await wait_running(session, worker_url)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await wait_idle(session, worker_url, timeout_s=RUN_OUT_S)
        assert await num_generated(session, worker_url) - before < body["max_tokens"]


async def test_ops_endpoints(worker_url: str, prompt_ids: list[list[int]]) -> None:
    async with aiohttp.ClientSession() as session:
        status, _ = await post(session, f"{worker_url}/v1/completions",
                               {"model": MODEL, "prompt": prompt_ids[3] * 2, "max_tokens": 1})
        assert status == 200   # a prompt of two full blocks: the prefix cache stores them
        status, _ = await post(session, f"{worker_url}/v1/completions",
                               {"model": MODEL, "prompt": prompt_ids[3] * 2, "max_tokens": 1})
        assert status == 200   # ... and serves them to the same prompt again
        async with session.get(f"{worker_url}/health") as resp:
            assert resp.status == 200
        async with session.get(f"{worker_url}/v1/models") as resp:
            models = await resp.json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        async with session.get(f"{worker_url}/v1/models/{MODEL}") as resp:
            assert resp.status == 200 and await resp.json() == models["data"][0]
        async with session.get(f"{worker_url}/v1/models/no-such-model") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
        async with session.get(f"{worker_url}/load") as resp:
            report = await resp.json()
        assert report["num_total_blocks"] == NUM_BLOCKS and report["block_size"] == 16
        assert {"num_prefill_tokens_pending", "num_decode_tokens_pending", "num_cached_blocks"} <= set(report)
        for field, metric in (("num_prompt_tokens", "prompt_tokens_total"),
                              ("num_cached_prompt_tokens", "prompt_cached_tokens_total")):
            value = await worker_metric(session, worker_url, f"switchyard_{metric}")
            assert report[field] == value > 0, field    # the prompt above ran: both counters moved
        async with session.get(f"{worker_url}/kv_events?since=0") as resp:
            events = await resp.json()
        assert events["events"] and events["next"] >= events["events"][-1]["seq_no"] > 0
        assert {e["kind"] for e in events["events"]} <= {"stored", "removed"}
        async with session.get(f"{worker_url}/kv_events?since={events['next']}") as resp:
            assert (await resp.json())["events"] == []
        async with session.get(f"{worker_url}/kv_events?since=-3") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "since"
        async with session.get(f"{worker_url}/metrics") as resp:
            metrics = await resp.text()
    for name in ("switchyard_num_requests_running", "switchyard_kv_blocks_free", "switchyard_kv_blocks_used",
                 "switchyard_prefix_cache_hit_rate", "switchyard_prompt_tokens_total",
                 "switchyard_prompt_cached_tokens_total", "switchyard_generation_tokens_total",
                 "switchyard_time_to_first_token_seconds_bucket", "switchyard_inter_token_latency_seconds_bucket",
                 'switchyard_requests_total{route="/v1/completions",status="200"}'):
        assert name in metrics, name
