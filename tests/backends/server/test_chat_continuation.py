"""vLLM's `continue_final_message` on a real worker (bundled SmolLM2, fp32 CPU): the answer continues the last,
assistant, message in place (a prefilled answer, as the gateway's Messages API sends it), token for token
transformers' greedy continuation of the prompt its own chat template renders that way; bad combinations are
400s naming the field."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import torch

from tests.backends.numerics import assert_same_text, assert_same_tokens
from tests.backends.references import smollm2_vocabulary
from tests.backends.server.hf_greedy import hf_greedy_run
from tests.backends.server.worker_client import post
from tests.support.worker_proc import WorkerProcess

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Finish my sentence about France."},
            {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def worker_url() -> Iterator[str]:
    worker = WorkerProcess(["--threads", "2", "--num-blocks", "64"])
    try:
        yield worker.url
    finally:
        worker.stop()


async def test_the_last_message_is_continued_in_place(worker_url: str, hf_smollm2: torch.nn.Module,
                                                      hf_smollm2_f64: torch.nn.Module) -> None:
    tokenizer, eos = smollm2_vocabulary()
    text = tokenizer.apply_chat_template(MESSAGES, continue_final_message=True, add_generation_prompt=False,
                                         tokenize=False)
    assert text.endswith(MESSAGES[-1]["content"])       # no end of turn, no new one
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    reference = hf_greedy_run(hf_smollm2, hf_smollm2_f64, [prompt], NUM_NEW_TOKENS, eos).references[0]
    body = {"model": "smollm2", "messages": MESSAGES, "continue_final_message": True, "temperature": 0,
            "max_tokens": NUM_NEW_TOKENS, "ignore_eos": True, "return_token_ids": True}
    async with aiohttp.ClientSession() as session:
        for extra in ({"add_generation_prompt": False}, {}):    # false is the default with it
            status, answer = await post(session, worker_url + "/v1/chat/completions", {**body, **extra})
            assert status == 200, answer
            assert answer["usage"]["prompt_tokens"] == len(prompt)
            choice = answer["choices"][0]
            assert_same_tokens(choice["token_ids"], reference.tokens, reference.choices, "continued")
            assert_same_text(choice["message"]["content"], reference.tokens, reference.choices,
                             lambda ids: tokenizer.decode(ids, skip_special_tokens=True), "continued")


@pytest.mark.parametrize(("extra", "param"), [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": True, "messages": MESSAGES[:1]}, "continue_final_message"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
    ({"add_generation_prompt": 1}, "add_generation_prompt"),
])
async def test_bad_continuations_are_400s(worker_url: str, extra: dict[str, Any], param: str) -> None:
    async with aiohttp.ClientSession() as session:
        status, error = await post(session, worker_url + "/v1/chat/completions",
                                   {"messages": MESSAGES, "max_tokens": 2, **extra})
        assert status == 400 and error["error"]["param"] == param, error
