"""Tiny random Mixtral, Qwen3-MoE and DeepSeek-V3 checkpoints (transformers' from_config, SmolLM2's tokenizer)
served by real worker processes (fp32 CPU), two per family, each started once: the unified one (role both, which
also prefills for the decode worker, as a `both` worker in a prefill pool does) and a decode worker.

- A completion's greedy tokens are transformers' `generate`'s.
- Prefill on one worker then decode on the other (P/D) gives the unified worker's tokens. The blocks the decode
  worker received (DeepSeek-V3's compressed latent) are byte for byte the ones the prefill worker held, copied
  through shared memory, and no block stays held.
- `n`: each of n greedy choices is transformers' greedy answer; each seeded choice k is the draw seed + k gives on
  transformers' logits for the same tokens; the prompt is counted once.
- Structured output: every answer to a `json_schema` request parses and follows the schema (by the schema tests'
  own validator, not the grammar)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from backends.core.sampling_params import SamplingParams
from tests.backends.engine.test_engine_model import hf_greedy
from tests.backends.models.moe_checkpoints import float64_twin, tiny_deepseek_v3, tiny_moe
from tests.backends.numerics import (
    Choice,
    assert_mostly_clear,
    assert_same_tokens,
    choices,
    logit_tolerance,
    teacher_forced_logits,
)
from tests.backends.pd_http import assert_idle, get, post
from tests.backends.references import prompt_ids, smollm2_vocabulary
from tests.backends.structured_output.test_json_schema import valid
from tests.support.worker_proc import WorkerProcess, started_workers

NAME = "tiny-moe"
BODY = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0,
        "return_token_ids": True}
COMMON = ["--threads", "1", "--num-blocks", "64", "--kv-hold-timeout-s", "8", "--kv-idle-timeout-s", "2",
          "--served-model-name", NAME, "--debug-endpoints"]


@dataclass(frozen=True)
class Served:
    model: PreTrainedModel                 # transformers' float32 model on the checkpoint's weights
    twin: torch.nn.Module                  # its float64 copy: the rounding tolerance is measured against it
    workers: dict[str, WorkerProcess]

    def url(self, name: str) -> str:
        return self.workers[name].url


def checkpoint(family: str, folder: Path) -> PreTrainedModel:
    """The family's tiny model over SmolLM2's vocabulary, saved with SmolLM2's tokenizer beside it."""
    tokenizer, eos = smollm2_vocabulary()
    vocabulary = dict(vocab_size=len(tokenizer), eos_token_id=list(eos))
    if family == "deepseek-v3":
        model = tiny_deepseek_v3(folder, 48, **vocabulary)
    else:
        model = tiny_moe(family, folder, **vocabulary)
    source = Path(tokenizer.name_or_path)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / file, folder / file)
    return model


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe", "deepseek-v3"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = checkpoint(request.param, folder)
    roles = {"unified": "both", "d1": "decode"}
    with started_workers({name: ["--role", role, "--model", str(folder), *COMMON] for name, role in roles.items()},
                         tmp_path_factory.mktemp(f"{request.param}-workers")) as started:
        yield Served(model, float64_twin(model), started)


def hf_reference(served: Served, prompt: list[int]) -> tuple[list[int], list[Choice]]:
    """transformers' greedy tokens after `prompt`, and where float32 rounding could decide them otherwise."""
    _, eos = smollm2_vocabulary()
    (want, logits), = hf_greedy(served.model, [prompt], BODY["max_tokens"], eos)
    tolerance = logit_tolerance(served.model, served.twin, [prompt + want])
    params = SamplingParams(max_tokens=BODY["max_tokens"], temperature=0.0)
    reference = choices(logits, params, None, eos, tolerance)
    assert_mostly_clear([reference], "transformers' greedy tokens")
    return want, reference


async def test_served_greedy_tokens_equal_transformers_and_pd_equals_unified(served: Served) -> None:
    tokenizer, _ = smollm2_vocabulary()
    want, reference = hf_reference(served, prompt_ids(tokenizer, BODY, chat=False))

    status, unified = await post(served.url("unified"), BODY)
    assert status == 200, unified
    unified_ids = unified["choices"][0]["token_ids"]
    assert_same_tokens(unified_ids, want, reference, "the unified worker against transformers")

    status, pre = await post(served.url("unified"),
                             {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, pre
    kv = pre["kv_transfer_params"]
    digest = f"/debug/kv_digest?transfer_id={kv['remote_request_id']}"
    held = (await get(served.url("unified") + digest))["held"]
    status, dec = await post(served.url("d1"), {**BODY, "kv_transfer_params": {**kv, "response_id": pre["id"]}})
    assert status == 200, dec
    pd_ids = kv["first_token_ids"] + dec["choices"][0]["token_ids"]
    assert_same_tokens(pd_ids, want, reference, "P/D against transformers")
    if unified_ids == want:
        assert_same_tokens(pd_ids, unified_ids, reference, "P/D against the unified worker")
    received = (await get(served.url("d1") + digest))["received"]
    assert received["digests"] and received["digests"] == held[received["start_block"]:]   # the bytes held
    totals = (await get(served.url("d1") + "/debug/kv_digest?transfer_id=-"))["totals"]
    assert totals["pulls"] > 0 and totals["shared_memory_pulls"] == totals["pulls"], totals
    await assert_idle([served.url("unified"), served.url("d1")])


async def test_n_greedy_and_seeded_choices_follow_transformers(served: Served) -> None:
    tokenizer, eos = smollm2_vocabulary()
    prompt = prompt_ids(tokenizer, BODY, chat=False)
    want, reference = hf_reference(served, prompt)
    status, greedy = await post(served.url("unified"), {**BODY, "n": 2})
    assert status == 200, greedy
    assert [c["index"] for c in greedy["choices"]] == [0, 1]
    for k, choice in enumerate(greedy["choices"]):
        assert_same_tokens(choice["token_ids"], want, reference, f"greedy choice {k} against transformers")

    body = {**BODY, "messages": [{"role": "user", "content": "Name a fruit."}], "n": 2, "max_tokens": 8,
            "temperature": 0.8, "top_k": 4, "seed": 2026, "ignore_eos": True}
    del body["prompt"]
    chat_prompt = prompt_ids(tokenizer, body, chat=True)
    status, seeded = await post(served.url("unified"), body, chat=True)
    assert status == 200, seeded
    assert [c["index"] for c in seeded["choices"]] == [0, 1]
    assert seeded["usage"]["prompt_tokens"] == len(chat_prompt)        # once, not n times
    assert seeded["usage"]["completion_tokens"] == 2 * 8
    answers = [c["token_ids"] for c in seeded["choices"]]
    assert [len(a) for a in answers] == [8, 8]
    tolerance = logit_tolerance(served.model, served.twin, [chat_prompt + a for a in answers])
    references = []
    for k, answer in enumerate(answers):
        # a random model's distribution over 49,152 tokens is flat: top_k keeps the draws clear of the rounding
        params = SamplingParams(max_tokens=8, temperature=0.8, top_k=4, seed=body["seed"] + k, ignore_eos=True)
        references.append(choices(teacher_forced_logits(served.model, chat_prompt, answer), params, params.seed,
                                  eos, tolerance, chat_prompt))
        assert_same_tokens(answer, answer, references[-1], f"seeded choice {k}: seed + {k}'s draw")
    assert_mostly_clear(references, "the seeded draws")
    await assert_idle([served.url("unified")])


# Only enums and booleans: however a random model picks among what the grammar allows, the object closes within
# max_tokens (whitespace runs are capped), so every answer must finish and validate.
PET = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog", "none"]}, "indoor": {"type": "boolean"},
                                        "colour": {"enum": ["red", "green", "blue"]}},
       "required": ["pet", "indoor", "colour"], "additionalProperties": False}


def chat_json(fields: dict[str, Any]) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": "Describe a pet as JSON."}], "max_tokens": 200,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "pet", "schema": PET, "strict": True}}, **fields}


async def test_answers_follow_a_json_schema(served: Served) -> None:
    url = served.url("unified")
    for fields in ({}, {"temperature": 1.0, "seed": 11, "n": 2}):
        status, body = await post(url, chat_json(fields), chat=True)
        assert status == 200, body
        assert len(body["choices"]) == fields.get("n", 1)
        for choice in body["choices"]:
            text = choice["message"]["content"]
            assert choice["finish_reason"] == "stop" and text.startswith("{") and text.endswith("}"), choice
            assert valid(json.loads(text), PET, PET), text
    status, body = await post(url, {"model": NAME, "prompt": "A colour as JSON:", "max_tokens": 40, "temperature": 0,
                                    "response_format": {"type": "json_schema", "json_schema": {
                                        "name": "c", "schema": {"enum": ["red", "green", "blue"]}}}})
    assert status == 200 and json.loads(body["choices"][0]["text"]) in ("red", "green", "blue"), body
    # the same without the constraint is no JSON: the checks above are not passed by the model alone
    status, plain = await post(url, {**chat_json({}), "max_tokens": 8, "response_format": {"type": "text"}}, chat=True)
    assert status == 200 and not plain["choices"][0]["message"]["content"].startswith("{"), plain
    await assert_idle([url])
