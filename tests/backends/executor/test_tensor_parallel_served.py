"""Workers over groups of ranks (rank 0 serves, the other ranks are processes it spawns; gloo on the CPU), on a
tiny random Llama with biases, against one rank and transformers: a tensor-parallel group of two
(`--tensor-parallel-size 2`), two pipeline stages (`--pipeline-parallel-size 2`) and both (four ranks):

- their greedy tokens are transformers' `generate`'s and the single-rank worker's, served directly and through
  the gateway (which sees one worker per group, with one load report);
- a prefix-cache hit gives the same tokens;
- a size that does not divide the model's heads, or more stages than layers, is refused at start, with the
  reason;
- the bundled SmolLM2 at TP=3 (one KV head per rank) and over two stages of its 30 layers.
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
GROUPS = {"tp2": ["--tensor-parallel-size", "2"], "pp2": ["--pipeline-parallel-size", "2"],
          "tp2pp2": ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]}


@dataclass(frozen=True)
class Served:
    folder: Path
    model: PreTrainedModel                 # transformers' float32 model on the checkpoint's weights
    twin: torch.nn.Module                  # its float64 copy: the rounding tolerance is measured against it
    workers: dict[str, WorkerProcess]      # the GROUPS, and "tp1" (one rank)

    def url(self, name: str) -> str:
        return self.workers[name].url


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_llama(folder)
    args = {"tp1": ["--model", str(folder), *COMMON],
            **{name: ["--model", str(folder), *flags, *COMMON] for name, flags in GROUPS.items()}}
    with started_workers(args, tmp_path_factory.mktemp("tp-workers")) as workers:
        ranks = [pid for name in GROUPS for pid in rank_pids(workers[name].pid)]
        assert len(ranks) == 1 + 1 + 3, ranks   # every rank but rank 0, which is the worker itself
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


async def test_groups_give_one_ranks_and_transformers_greedy_tokens(served: Served, tmp_path: Path) -> None:
    tokenizer, _ = smollm2_vocabulary()
    want, reference = hf_reference(served, prompt_ids(tokenizer, BODY, chat=False), BODY["max_tokens"])
    answers = {}
    for name in ("tp1", *GROUPS):
        status, body = await post(served.url(name), BODY)
        assert status == 200, body
        answers[name] = body["choices"][0]["token_ids"]
        assert_same_tokens(answers[name], want, reference, f"{name} against transformers")
        assert_same_tokens(answers[name], answers["tp1"], reference, f"{name} against one rank")

    gateway = GatewayProcess({   # every group behind one model: whichever it picks answers one rank's tokens
        "models": {NAME: {"tokenizer": str(served.folder), "providers": ["groups"]}},
        "providers": {"groups": {"kind": "openai", "endpoints": [served.url(n) for n in GROUPS],
                                 "offers_load": True}},
    }, tmp_path, start_timeout_s=120)   # its import and first health checks: over 30 s on a loaded 2-core VM
    try:
        for _ in GROUPS:
            status, body = await post(gateway.url, BODY)
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == answers["tp1"]
    finally:
        gateway.stop()
    for name in GROUPS:
        report = await get(served.url(name) + "/load")   # one worker, one report: rank 0's scheduler's
        assert report["num_total_blocks"] == 64, report
    await assert_idle([served.url(name) for name in ("tp1", *GROUPS)])


@pytest.mark.parametrize("group", list(GROUPS))
async def test_a_prefix_cache_hit_gives_the_same_tokens(served: Served, group: str) -> None:
    body = {**BODY, "prompt": "Once upon a time, in a land far away, there lived a king who had three daughters, "
                              "and each of them was more beautiful than the last. The youngest", "max_tokens": 8}
    tokenizer, _ = smollm2_vocabulary()
    prompt = prompt_ids(tokenizer, body, chat=False)
    assert len(prompt) >= 32   # two full blocks of 16: the second request finds them cached
    want, reference = hf_reference(served, prompt, body["max_tokens"])
    first_status, first = await post(served.url(group), body)
    second_status, second = await post(served.url(group), body)
    assert first_status == second_status == 200, (first, second)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32, second["usage"]
    assert_same_tokens(first["choices"][0]["token_ids"], want, reference, "the first request against transformers")
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    await assert_idle([served.url(group)])


@pytest.mark.parametrize(("flags", "message"), [
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size 3 does not divide the model's 4 attention heads"),
    (["--pipeline-parallel-size", "3"], "--pipeline-parallel-size 3 is more than the model's 2 layers"),
])
def test_a_split_the_model_does_not_allow_is_refused_at_start(served: Served, flags: list[str],
                                                               message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "backends.server", "--port", "1", "--model", str(served.folder),
                           *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


@pytest.mark.parametrize(("flags", "last_rank"), [
    (["--tensor-parallel-size", "3"], 2),     # one KV head per rank
    (["--pipeline-parallel-size", "2"], 1),   # layers 0-14 and 15-29
])
def test_smollm2_over_a_group_gives_transformers_greedy_tokens(smollm2_dir: Path, hf_smollm2: torch.nn.Module,
                                                               hf_smollm2_f64: torch.nn.Module, tmp_path: Path,
                                                               flags: list[str], last_rank: int) -> None:
    """The bundled SmolLM2 (9 query heads, 3 KV heads, 30 layers, tied embeddings)."""
    import asyncio

    tokenizer, eos = smollm2_vocabulary()
    body = {**BODY, "model": "smollm2"}
    prompt = prompt_ids(tokenizer, body, chat=False)
    (want, logits), = hf_greedy(hf_smollm2, [prompt], body["max_tokens"], eos)
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [prompt + want])
    reference = choices(logits, SamplingParams(max_tokens=body["max_tokens"], temperature=0.0), None, eos, tolerance)
    worker = WorkerProcess(["--model", "smollm2", *flags, "--threads", "1", "--num-blocks", "64"], log_dir=tmp_path)
    try:
        status, answer = asyncio.run(post(worker.url, body))
        assert status == 200, answer
        assert_same_tokens(answer["choices"][0]["token_ids"], want, reference, f"{flags} against transformers")
        assert f"rank {last_rank}:" in worker.log() and "KV blocks" in worker.log()   # each rank's memory, at start
    finally:
        worker.stop()
