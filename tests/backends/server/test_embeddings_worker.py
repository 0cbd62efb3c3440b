"""POST /v1/embeddings on real worker processes (bundled model, fp32 CPU).

Vectors are compared with transformers' own (the last token's final hidden state, normalised) within the
float32 rounding measured against its float64 twin (tests/backends/numerics.py): alone, batched, base64,
through the OpenAI SDK, beside a greedy generation stream (whose tokens must not change), and on workers
started in the disaggregated roles. Bad inputs get OpenAI-style 400s and leave the worker serving with
every KV block free.
"""
from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import orjson
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from tests.backends.numerics import assert_same_text, assert_same_tokens, embedding_tolerance, last_token_embedding
from tests.backends.server.hf_greedy import GreedyReference, hf_greedy_run
from tests.backends.server.worker_client import post, wait_idle, wait_running, worker_metric
from tests.support.wait import await_until
from tests.support.worker_proc import WorkerProcess, started_workers, supervised

pytestmark = pytest.mark.slow

MODEL = "smollm2"
HIDDEN_SIZE = 576
MAX_MODEL_LEN = 256
BUDGET = 32        # --max-num-batched-tokens: a long input runs in several prefill chunks
NUM_BLOCKS = 128
API_KEY = "sk-embed-test"
WORKER_ARGS = ["--model", MODEL, "--max-num-seqs", "32", "--num-blocks", str(NUM_BLOCKS), "--max-num-batched-tokens",
               str(BUDGET), "--max-model-len", str(MAX_MODEL_LEN), "--threads", "2"]
TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    # over a KV block (16 tokens) and over a prefill chunk (32): about 90 tokens
    "Embeddings map text to vectors so that texts of similar meaning lie close together. A decoder model "
    "served as an embedding model takes the final hidden state of the last token of its input, normalised "
    "to unit length, as that vector; this worker computes it in the same batches as its generation requests, "
    "chunked, cached and scheduled like any prompt.",
]
TOKEN_INPUTS = [[(37 * i + 11) % 20000 + 100 for i in range(45)], [4093, 314, 253]]
ALL_INPUTS: list[str | list[int]] = [*TEXTS, *TOKEN_INPUTS]
BATCHES: list[list[str] | list[list[int]]] = [TEXTS, TOKEN_INPUTS]   # an input list is all texts or all ids
GEN_PROMPT_LEN = 16
GEN_TOKENS = 64
EOS = (2,)


@dataclass(frozen=True)
class References:
    ids: dict[str, list[int]]             # every input (a text, or str() of its token ids) -> its token ids
    vectors: dict[str, torch.Tensor]      # -> transformers' normalised last hidden state (float64)
    tolerance: float                      # max abs difference two float32 evaluations may show


def key(one: object) -> str:
    return one if isinstance(one, str) else str(one)


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    proc = WorkerProcess(WORKER_ARGS, wait=False)   # loads while the references are computed
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def references(worker: WorkerProcess, hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module,
               smollm2_tokenizer: PreTrainedTokenizerBase) -> References:
    ids = {key(t): list(smollm2_tokenizer(t).input_ids) for t in TEXTS} | {key(t): t for t in TOKEN_INPUTS}
    assert len(ids[TEXTS[2]]) > BUDGET > 16
    vectors = {k: last_token_embedding(hf_smollm2, row) for k, row in ids.items()}
    return References(ids, vectors, embedding_tolerance(hf_smollm2, hf_smollm2_f64, list(ids.values())))


@pytest.fixture(scope="module")
def worker_url(worker: WorkerProcess, references: References) -> Iterator[str]:
    with supervised(worker) as url:
        yield url


def decode(item: dict[str, Any]) -> torch.Tensor:
    """One `data` item's vector, float or base64, as float64."""
    value = item["embedding"]
    if isinstance(value, str):
        raw = base64.b64decode(value)
        assert len(raw) == 4 * HIDDEN_SIZE
        return torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float64))
    assert len(value) == HIDDEN_SIZE and all(isinstance(x, float) for x in value)
    return torch.tensor(value, dtype=torch.float64)


def assert_close(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> None:
    cosine = torch.dot(got, want).item() / (got.norm() * want.norm()).item()
    deviation = (got - want).abs().max().item()
    assert cosine >= 0.9999 and deviation <= tolerance, f"{what}: cosine {cosine}, max |diff| {deviation} > {tolerance}"


async def embed(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = await post(session, f"{url}/v1/embeddings", body)
    assert status == 200, out
    assert set(out) == {"object", "data", "model", "usage"} and out["object"] == "list" and out["model"] == MODEL
    assert [(d["object"], d["index"]) for d in out["data"]] == [("embedding", i) for i in range(len(out["data"]))]
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"]
    return out


async def test_each_input_alone_matches_transformers(worker_url: str, references: References) -> None:
    async with aiohttp.ClientSession() as session:
        for one in ALL_INPUTS:
            out = await embed(session, worker_url, {"model": MODEL, "input": one})
            assert len(out["data"]) == 1
            assert out["usage"]["prompt_tokens"] == len(references.ids[key(one)])
            assert_close(decode(out["data"][0]), references.vectors[key(one)], references.tolerance, key(one)[:30])
        # A string is tokenized as /v1/completions tokenizes a prompt.
        status, completion = await post(session, f"{worker_url}/v1/completions",
                                        {"model": MODEL, "prompt": TEXTS[2], "max_tokens": 1})
        assert status == 200 and completion["usage"]["prompt_tokens"] == len(references.ids[TEXTS[2]])
        await wait_idle(session, worker_url)


async def test_batches_equal_single_requests_in_float_and_base64(worker_url: str, references: References) -> None:
    async with aiohttp.ClientSession() as session:
        singles = {key(one): decode((await embed(session, worker_url, {"input": one}))["data"][0])
                   for one in ALL_INPUTS}
        for batch in BATCHES:
            floats = await embed(session, worker_url, {"model": MODEL, "input": batch, "encoding_format": "float"})
            b64 = await embed(session, worker_url, {"model": MODEL, "input": batch, "encoding_format": "base64"})
            for out in (floats, b64):
                assert out["usage"]["prompt_tokens"] == sum(len(references.ids[key(one)]) for one in batch)
                for one, item in zip(batch, out["data"], strict=True):   # in request order
                    assert_close(decode(item), singles[key(one)], references.tolerance, f"batched {key(one)[:30]}")
                    assert_close(decode(item), references.vectors[key(one)], references.tolerance, key(one)[:30])
        await wait_idle(session, worker_url)
    # The unmodified OpenAI SDK (it asks for base64 and decodes it itself).
    client = openai.OpenAI(base_url=f"{worker_url}/v1", api_key="x", max_retries=0)
    response = client.embeddings.create(model=MODEL, input=TEXTS)
    assert response.usage.prompt_tokens == sum(len(references.ids[t]) for t in TEXTS)
    for text, item in zip(TEXTS, response.data, strict=True):
        assert_close(torch.tensor(item.embedding, dtype=torch.float64), references.vectors[text],
                     references.tolerance, f"SDK {text[:30]}")


async def test_optional_fields_are_accepted_and_a_full_context_fits(worker_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        out = await embed(session, worker_url, {"input": "x", "dimensions": HIDDEN_SIZE, "user": "someone",
                                                "encoding_format": None, "some_extension": {"a": 1}})
        assert len(decode(out["data"][0])) == HIDDEN_SIZE
        full = await embed(session, worker_url, {"input": [7] * MAX_MODEL_LEN})   # no room for output needed
        assert full["usage"]["prompt_tokens"] == MAX_MODEL_LEN
        await wait_idle(session, worker_url)


@pytest.fixture(scope="module")
def greedy_reference(hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module,
                     smollm2_tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], GreedyReference]:
    ids = list(smollm2_tokenizer("Once upon a time, in a small village at the edge of a great forest, "
                                 "there lived an old").input_ids)[:GEN_PROMPT_LEN]
    return ids, hf_greedy_run(hf_smollm2, hf_smollm2_f64, [ids], GEN_TOKENS, EOS).references[0]


async def test_embeddings_beside_a_generation_stream(worker_url: str, references: References,
                                                     greedy_reference: tuple[list[int], GreedyReference],
                                                     smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    """The same greedy request alone and with embeddings computed while it streams: the same tokens (where
    rounding cannot decide: another batch rounds its logits otherwise), and the embeddings still correct."""
    ids, reference = greedy_reference
    body = {"model": MODEL, "prompt": ids, "max_tokens": GEN_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    received: list[int] = []
    text: list[str] = []

    async def stream(session: aiohttp.ClientSession) -> None:
        async with session.post(f"{worker_url}/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    choice = orjson.loads(line[6:])["choices"][0]
                    received.extend(choice["token_ids"])
                    text.append(choice["text"])

    def decode_text(token_ids: Sequence[int]) -> str:
        return str(smollm2_tokenizer.decode(list(token_ids), skip_special_tokens=True))

    async with aiohttp.ClientSession() as session:
        status, alone = await post(session, f"{worker_url}/v1/completions", body)
        assert status == 200, alone
        alone_ids = alone["choices"][0]["token_ids"]
        assert_same_tokens(alone_ids, reference.tokens, reference.choices, "alone against transformers")
        streaming = asyncio.ensure_future(stream(session))
        await await_until(lambda: len(received) > 0, "the stream's first token")
        outs = await asyncio.gather(*(embed(session, worker_url, {"input": batch}) for batch in BATCHES))
        assert not streaming.done() and len(received) < GEN_TOKENS, "the generation ended before the embeddings"
        await streaming
        assert_same_tokens(received, alone_ids, reference.choices, "beside embeddings against alone")
        assert_same_text("".join(text), alone_ids, reference.choices, decode_text, "beside embeddings")
        for batch, out in zip(BATCHES, outs, strict=True):
            for one, item in zip(batch, out["data"], strict=True):
                assert_close(decode(item), references.vectors[key(one)], references.tolerance, key(one)[:30])
        await wait_idle(session, worker_url)


VOCAB = 49152
BAD_INPUTS = [
    # (body, status, param, code)
    ({}, 400, "input", "missing_required_parameter"),
    ({"input": None}, 400, "input", "missing_required_parameter"),
    ({"input": ""}, 400, "input", "invalid_value"),
    ({"input": []}, 400, "input", "invalid_value"),
    ({"input": [[]]}, 400, "input", "invalid_value"),
    ({"input": ["fine", ""]}, 400, "input", "invalid_value"),
    ({"input": [1, 2.5]}, 400, "input", "invalid_value"),
    ({"input": [1, True]}, 400, "input", "invalid_value"),
    ({"input": [5, VOCAB]}, 400, "input", "invalid_value"),
    ({"input": [-1]}, 400, "input", "invalid_value"),
    ({"input": [[5], [10**12]]}, 400, "input", "invalid_value"),
    ({"input": [[5], "text"]}, 400, "input", "invalid_value"),
    ({"input": [["text"]]}, 400, "input", "invalid_value"),
    ({"input": 42}, 400, "input", "invalid_value"),
    ({"input": {"text": "x"}}, 400, "input", "invalid_value"),
    ({"input": ["a"] * 65}, 400, "input", "invalid_value"),
    ({"input": [[3]] * 65}, 400, "input", "invalid_value"),
    ({"input": [7] * (MAX_MODEL_LEN + 1)}, 400, "input", "context_length_exceeded"),
    ({"input": ["short", "word " * (MAX_MODEL_LEN + 10)]}, 400, "input", "context_length_exceeded"),
    ({"input": "x", "dimensions": 256}, 400, "dimensions", "unsupported_parameter"),
    ({"input": "x", "dimensions": "576"}, 400, "dimensions", "invalid_value"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", "invalid_value"),
    ({"input": "x", "encoding_format": ["float"]}, 400, "encoding_format", "invalid_value"),
    ({"input": "x", "model": "no-such-model"}, 404, "model", "model_not_found"),
    ({"input": "x", "model": 5}, 400, "model", "invalid_value"),
    ({"input": "x", "user": 5}, 400, "user", "invalid_value"),
    (b'{"input": "x",', 400, None, "invalid_json"),
    ([1, 2], 400, None, None),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD_INPUTS)
async def test_bad_input_gets_openai_error_and_worker_still_serves(
        worker_url: str, body: Any, status: int, param: str | None, code: str | None) -> None:
    async with aiohttp.ClientSession() as session:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with session.post(f"{worker_url}/v1/embeddings", **kwargs) as resp:
            assert resp.status == status and resp.content_type == "application/json"
            error = (await resp.json())["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
        async with session.get(f"{worker_url}/health") as resp:
            assert resp.status == 200
        out = await embed(session, worker_url, {"input": "still serving"})
        assert len(out["data"]) == 1
        await wait_idle(session, worker_url)


async def test_client_disconnect_aborts_every_input(worker_url: str) -> None:
    """64 distinct inputs of 200 tokens: far more than the cache holds at once (most wait for blocks). The client
    goes away once they run: every one is aborted, the KV blocks all free, long before they could all finish."""
    batch = [[(i * 509 + j * 13) % 30000 + 100 for j in range(200)] for i in range(64)]
    async with aiohttp.ClientSession() as session:
        before = await worker_metric(session, worker_url, "switchyard_prompt_tokens_total")
        pending = asyncio.ensure_future(session.post(f"{worker_url}/v1/embeddings", json={"input": batch}))
        await wait_running(session, worker_url)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        report = await wait_idle(session, worker_url)
        assert report["num_total_blocks"] == NUM_BLOCKS
        done = await worker_metric(session, worker_url, "switchyard_prompt_tokens_total") - before
        assert done < 64 * 200, "every input ran to the end: the disconnect aborted nothing"
        out = await embed(session, worker_url, {"input": batch[0]})   # and the worker serves on
        assert out["usage"]["prompt_tokens"] == 200


async def test_requests_are_counted_per_route(worker_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await embed(session, worker_url, {"input": "count me"})
        status, _ = await post(session, f"{worker_url}/v1/embeddings", {"input": ""})
        assert status == 400
        async with session.get(f"{worker_url}/metrics") as resp:
            metrics = await resp.text()
    for status_label in ("200", "400"):
        assert f'switchyard_requests_total{{route="/v1/embeddings",status="{status_label}"}}' in metrics


async def test_disaggregated_roles_answer_embeddings_whole(references: References, tmp_path: Path) -> None:
    """A prefill-role and a decode-role worker each answer an embedding request as a whole request; the API key
    guards the route like the other /v1 routes."""
    args = {"prefill": ["--role", "prefill", "--api-key", API_KEY, *WORKER_ARGS],
            "decode": ["--role", "decode", *WORKER_ARGS]}
    with started_workers(args, tmp_path) as workers:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{workers['prefill'].url}/v1/embeddings", json={"input": "x"}) as resp:
                assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
            for name, headers in (("prefill", auth), ("decode", {})):
                async with aiohttp.ClientSession(headers=headers) as keyed:
                    out = await embed(keyed, workers[name].url, {"input": [TEXTS[2], TEXTS[0]]})
                    for text, item in zip([TEXTS[2], TEXTS[0]], out["data"], strict=True):
                        assert_close(decode(item), references.vectors[text], references.tolerance, name)
                    await wait_idle(keyed, workers[name].url)
