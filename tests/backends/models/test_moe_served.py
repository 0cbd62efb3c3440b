"""A tiny random Qwen3-MoE checkpoint (transformers' from_config, SmolLM2's tokenizer) served by real worker
processes (fp32 CPU): a completion's greedy tokens are transformers' `generate`'s, and prefill on one worker then
decode on another (P/D, the KV pulled between them) gives the unified worker's tokens. Two workers: the unified
one (role both) prefills for the decode worker too, as a `both` worker in a prefill pool does."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from backends.core.sampling_params import SamplingParams
from tests.backends.engine.test_engine_model import hf_greedy
from tests.backends.models.moe_checkpoints import float64_twin, tiny_moe
from tests.backends.numerics import Choice, assert_mostly_clear, assert_same_tokens, choices, logit_tolerance
from tests.backends.pd_http import assert_idle, post
from tests.backends.references import prompt_ids, smollm2_vocabulary
from tests.support.worker_proc import WorkerProcess, started_workers

NAME = "tiny-moe"
BODY = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0,
        "return_token_ids": True}
COMMON = ["--threads", "1", "--num-blocks", "64", "--kv-hold-timeout-s", "8", "--kv-idle-timeout-s", "2",
          "--served-model-name", NAME]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    tokenizer, eos = smollm2_vocabulary()
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    model = tiny_moe("qwen3-moe", folder, vocab_size=len(tokenizer), eos_token_id=list(eos))
    source = Path(tokenizer.name_or_path)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / file, folder / file)
    return folder, model


@pytest.fixture(scope="module")
def workers(checkpoint: tuple[Path, PreTrainedModel],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    folder, _ = checkpoint
    roles = {"unified": "both", "d1": "decode"}
    with started_workers({name: ["--role", role, "--model", str(folder), *COMMON] for name, role in roles.items()},
                         tmp_path_factory.mktemp("moe-workers")) as started:
        yield started


def hf_reference(model: PreTrainedModel, prompt: list[int]) -> tuple[list[int], list[Choice]]:
    """transformers' greedy tokens after `prompt`, and where float32 rounding could decide them otherwise."""
    _, eos = smollm2_vocabulary()
    (want, logits), = hf_greedy(model, [prompt], BODY["max_tokens"], eos)
    tolerance = logit_tolerance(model, float64_twin(model), [prompt + want])
    params = SamplingParams(max_tokens=BODY["max_tokens"], temperature=0.0)
    return want, choices(logits, params, None, eos, tolerance)


async def test_served_greedy_tokens_equal_transformers_and_pd_equals_unified(
        workers: dict[str, WorkerProcess], checkpoint: tuple[Path, PreTrainedModel]) -> None:
    _, model = checkpoint
    tokenizer, _ = smollm2_vocabulary()
    want, reference = hf_reference(model, prompt_ids(tokenizer, BODY, chat=False))
    assert_mostly_clear([reference], "transformers' greedy tokens")

    status, unified = await post(workers["unified"].url, BODY)
    assert status == 200, unified
    unified_ids = unified["choices"][0]["token_ids"]
    assert_same_tokens(unified_ids, want, reference, "the unified worker against transformers")

    status, pre = await post(workers["unified"].url,
                             {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, pre
    kv = pre["kv_transfer_params"]
    status, dec = await post(workers["d1"].url, {**BODY, "kv_transfer_params": {**kv, "response_id": pre["id"]}})
    assert status == 200, dec
    pd_ids = kv["first_token_ids"] + dec["choices"][0]["token_ids"]
    assert_same_tokens(pd_ids, want, reference, "P/D against transformers")
    if unified_ids == want:
        assert_same_tokens(pd_ids, unified_ids, reference, "P/D against the unified worker")
    await assert_idle([workers["unified"].url, workers["d1"].url])
