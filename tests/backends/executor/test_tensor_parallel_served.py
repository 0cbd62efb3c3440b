"""A worker over a tensor-parallel group of two ranks (`--tensor-parallel-size 2`: rank 0 serves, rank 1 is a
process it spawns; gloo on the CPU), on a tiny random Llama with biases, against one rank and transformers:

- its greedy tokens are transformers' `generate`'s and the single-rank worker's, served directly and through
  the gateway (which sees one worker with one load report);
- a prefix-cache hit gives the same tokens;
- a size that does not divide the model's heads is refused at start, with the reason.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from backends.core.sampling_params import SamplingParams
from tests.backends.engine.test_engine_model import hf_greedy
from tests.backends.executor.ranks import gone, rank_pids
from tests.backends.executor.tp_checkpoints import tiny_llama
from tests.backends.numerics import (
    Choice,
    assert_mostly_clear,
    assert_same_tokens,
    choices,
    float64_copy,
    logit_tolerance,
)
from tests.backends.pd_http import assert_idle, get, post
from tests.backends.references import prompt_ids, smollm2_vocabulary
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import wait_until
from tests.support.worker_proc import REPO_ROOT, WorkerProcess, started_workers

pytestmark = pytest.mark.slow

NAME = "tiny-llama"
BODY = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0,
        "return_token_ids": True}
COMMON = ["--threads", "1", "--num-blocks", "64", "--served-model-name", NAME]


@dataclass(frozen=True)
class Served:
    folder: Path
    model: PreTrainedModel                 # transformers' float32 model on the checkpoint's weights
    twin: torch.nn.Module                  # its float64 copy: the rounding tolerance is measured against it
    workers: dict[str, WorkerProcess]      # "tp2" (the group) and "tp1" (one rank)

    def url(self, name: str) -> str:
        return self.workers[name].url


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_llama(folder)
    args = {"tp2": ["--model", str(folder), "--tensor-parallel-size", "2", *COMMON],
            "tp1": ["--model", str(folder), *COMMON]}
    with started_workers(args, tmp_path_factory.mktemp("tp-workers")) as workers:
        ranks = rank_pids(workers["tp2"].pid)
        assert len(ranks) == 1, ranks   # rank 1; rank 0 is the worker itself
        yield Served(folder, model, float64_copy(model), workers)
    wait_until(lambda: all(gone(pid) for pid in ranks), "the group's ranks to exit with the worker")


def hf_reference(served: Served, prompt: list[int], max_tokens: int) -> tuple[list[int], list[Choice]]:
    """transformers' greedy tokens after `prompt`, and where float32 rounding could decide them otherwise."""
    _, eos = smollm2_vocabulary()
    (want, logits), = hf_greedy(served.model, [prompt], max_tokens, eos)
    tolerance = logit_tolerance(served.model, served.twin, [prompt + want])
    reference = choices(logits, SamplingParams(max_tokens=max_tokens, temperature=0.0), None, eos, tolerance)
    assert_mostly_clear([reference], "transformers' greedy tokens")
    return want, reference


async def test_two_ranks_give_one_ranks_and_transformers_greedy_tokens(served: Served,
                                                                      tmp_path: Path) -> None:
    tokenizer, _ = smollm2_vocabulary()
    want, reference = hf_reference(served, prompt_ids(tokenizer, BODY, chat=False), BODY["max_tokens"])
    answers = {}
    for name in ("tp2", "tp1"):
        status, body = await post(served.url(name), BODY)
        assert status == 200, body
        answers[name] = body["choices"][0]["token_ids"]
        assert_same_tokens(answers[name], want, reference, f"{name} against transformers")
    assert_same_tokens(answers["tp2"], answers["tp1"], reference, "two ranks against one")

    gateway = GatewayProcess({
        "models": {NAME: {"tokenizer": str(served.folder), "providers": ["group"]}},
        "providers": {"group": {"kind": "openai", "endpoints": [served.url("tp2")], "offers_load": True}},
    }, tmp_path)
    try:
        status, body = await post(gateway.url, BODY)
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == answers["tp2"]
    finally:
        gateway.stop()
    report = await get(served.url("tp2") + "/load")   # one worker, one report: rank 0's scheduler's
    assert report["num_total_blocks"] == 64, report
    await assert_idle([served.url("tp2"), served.url("tp1")])


async def test_a_prefix_cache_hit_gives_the_same_tokens(served: Served) -> None:
    body = {**BODY, "prompt": "Once upon a time, in a land far away, there lived a king who had three daughters, "
                              "and each of them was more beautiful than the last. The youngest", "max_tokens": 8}
    tokenizer, _ = smollm2_vocabulary()
    prompt = prompt_ids(tokenizer, body, chat=False)
    assert len(prompt) >= 32   # two full blocks of 16: the second request finds them cached
    want, reference = hf_reference(served, prompt, body["max_tokens"])
    first_status, first = await post(served.url("tp2"), body)
    second_status, second = await post(served.url("tp2"), body)
    assert first_status == second_status == 200, (first, second)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32, second["usage"]
    assert_same_tokens(first["choices"][0]["token_ids"], want, reference, "the first request against transformers")
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    await assert_idle([served.url("tp2")])


def test_a_size_that_does_not_divide_the_heads_is_refused_at_start(served: Served) -> None:
    done = subprocess.run([sys.executable, "-m", "backends.server", "--port", "1", "--model", str(served.folder),
                           "--tensor-parallel-size", "3"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads" in done.stderr, done.stderr


def test_smollm2_over_three_ranks_gives_transformers_greedy_tokens(smollm2_dir: Path, hf_smollm2: torch.nn.Module,
                                                                   hf_smollm2_f64: torch.nn.Module,
                                                                   tmp_path: Path) -> None:
    """The bundled SmolLM2 (9 query heads, 3 KV heads, tied embeddings): one KV head per rank at TP=3."""
    import asyncio

    tokenizer, eos = smollm2_vocabulary()
    body = {**BODY, "model": "smollm2"}
    prompt = prompt_ids(tokenizer, body, chat=False)
    (want, logits), = hf_greedy(hf_smollm2, [prompt], body["max_tokens"], eos)
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [prompt + want])
    reference = choices(logits, SamplingParams(max_tokens=body["max_tokens"], temperature=0.0), None, eos, tolerance)
    worker = WorkerProcess(["--model", "smollm2", "--tensor-parallel-size", "3", "--threads", "1",
                            "--num-blocks", "64"], log_dir=tmp_path)
    try:
        status, answer = asyncio.run(post(worker.url, body))
        assert status == 200, answer
        assert_same_tokens(answer["choices"][0]["token_ids"], want, reference, "TP=3 against transformers")
        assert "rank 2:" in worker.log() and "KV blocks" in worker.log()   # each rank's memory, logged at start
    finally:
        worker.stop()
