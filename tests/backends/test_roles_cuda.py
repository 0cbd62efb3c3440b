"""The `both`, `prefill` and `decode` roles on CUDA (`gpu`): three real worker processes on one GPU, the
bundled SmolLM2 in float32, decode through CUDA graphs. A unified answer and the two legs of a
disaggregated one (KV pulled from the prefill worker's GPU cache through pinned host memory) both give
transformers' greedy tokens, up to the first position where float32 rounding could go either way; the
prefill worker holds no block afterwards."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import torch

from backends.core.sampling_params import SamplingParams
from tests.backends.numerics import (
    assert_mostly_clear,
    assert_same_tokens,
    choices,
    logit_tolerance,
    teacher_forced_logits,
)
from tests.support.wait import await_until
from tests.support.worker_proc import WorkerProcess, started_workers

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "List three colors:"]
MAX_TOKENS = 16
COMMON = ["--device", "cuda", "--dtype", "float32", "--num-blocks", "256", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    debug = {"decode": ["--debug-endpoints"]}   # its pull totals
    with started_workers({role: ["--role", role, *COMMON, *debug.get(role, [])]
                          for role in ("both", "prefill", "decode")},
                         tmp_path_factory.mktemp("cuda-roles")) as workers:
        yield workers


async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        payload = orjson.loads(await r.read())
        assert r.status == 200, payload
        return payload


async def get(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return orjson.loads(await r.read())


def test_unified_and_disaggregated_on_cuda_give_transformers_tokens(
        workers: dict[str, WorkerProcess], smollm2_dir: Path, hf_smollm2: torch.nn.Module,
        hf_smollm2_f64: torch.nn.Module) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    body = {"model": "smollm2", "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}

    async def answers(prompt: str) -> tuple[list[int], list[int]]:
        unified = await post(workers["both"].url, {**body, "prompt": prompt})
        pre = await post(workers["prefill"].url, {**body, "prompt": prompt, "max_tokens": 1,
                                                  "kv_transfer_params": {"do_remote_decode": True}})
        kv = pre["kv_transfer_params"]
        dec = await post(workers["decode"].url, {**body, "prompt": prompt,
                                                 "kv_transfer_params": {**kv, "response_id": pre["id"]}})
        assert dec["usage"]["completion_tokens"] == MAX_TOKENS
        return unified["choices"][0]["token_ids"], kv["first_token_ids"] + dec["choices"][0]["token_ids"]

    async def run_all() -> list[tuple[list[int], list[int]]]:
        got = [await answers(p) for p in PROMPTS]
        async def prefill_holds_nothing() -> bool:
            return (await get(workers["prefill"].url + "/load"))["num_held_blocks"] == 0
        await await_until(prefill_holds_nothing, "the prefill worker to release its held blocks")
        totals = (await get(workers["decode"].url + "/debug/kv_digest?transfer_id=-"))["totals"]
        # two processes on one GPU: every pull went device to device
        assert totals["pulls"] > 0 and totals["cuda_ipc_pulls"] == totals["pulls"], totals
        return got

    got = asyncio.run(run_all())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    wants = []
    for prompt in prompts:
        with torch.inference_mode():
            out = hf_smollm2.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                      min_new_tokens=MAX_TOKENS, pad_token_id=0)
        wants.append(out[0, len(prompt):].tolist())
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [p + w for p, w in zip(prompts, wants, strict=True)])
    from backends.engine.engine import eos_token_ids
    from backends.models.model_config import load_model_config
    eos = eos_token_ids(load_model_config(smollm2_dir), smollm2_dir)
    references = []
    for prompt, want, (unified, legs) in zip(prompts, wants, got, strict=True):
        reference = choices(teacher_forced_logits(hf_smollm2, prompt, want), params, None, eos, tolerance, prompt)
        references.append(reference)
        assert_same_tokens(unified, want, reference, f"the both worker on CUDA, {prompt}")
        assert_same_tokens(legs, want, reference, f"prefill and decode workers on CUDA, {prompt}")
    assert_mostly_clear(references, "transformers' greedy tokens")
