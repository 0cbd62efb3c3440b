"""transformers' greedy continuation of prompts as the reference a worker's greedy answers must repeat: tokens,
logprobs, where float32 rounding could decide otherwise, and the tolerance measured on them
(tests/backends/numerics.py). Computing references only: the worker and its requests stay with the tests."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from backends.core.sampling_params import SamplingParams
from tests.backends.numerics import Choice, assert_mostly_clear, choices, logit_tolerance


@dataclass(frozen=True)
class GreedyReference:
    tokens: list[int]          # transformers' greedy continuation (EOS suppressed, as under ignore_eos)
    logprobs: list[float]      # each token's logprob
    choices: list[Choice]      # whether float32 rounding could have chosen another token at each position


@dataclass(frozen=True)
class HFGreedy:
    references: list[GreedyReference]   # one per prompt
    tolerance: float                    # how far apart two float32 evaluations of these logits may land


def hf_float32_model(request: pytest.FixtureRequest, model: str) -> torch.nn.Module:
    """The session's float32 transformers model (`hf_smollm2`), or `model` loaded from the bundled weights."""
    try:
        return request.getfixturevalue("hf_smollm2")
    except pytest.FixtureLookupError:
        from transformers import LlamaForCausalLM

        from backends.worker.loader import resolve_model

        return LlamaForCausalLM.from_pretrained(str(resolve_model(model)), dtype=torch.float32).eval()


def hf_greedy_run(model: torch.nn.Module, model_f64: torch.nn.Module, prompt_ids: list[list[int]],
                  num_new_tokens: int, eos: Sequence[int]) -> HFGreedy:
    """transformers' greedy continuation of each prompt (all of one length: HF batches them unpadded; `eos`
    suppressed, like ignore_eos), each token's logprob, where float32 rounding could decide otherwise, and the
    tolerance measured on them."""
    prompt_len = len(prompt_ids[0])
    assert all(len(p) == prompt_len for p in prompt_ids)
    greedy = SamplingParams(max_tokens=num_new_tokens, temperature=0.0, ignore_eos=True)
    default_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None   # like ignore_eos: all num_new_tokens come
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor(prompt_ids), max_new_tokens=num_new_tokens, do_sample=False,
                                 suppress_tokens=list(eos), output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = default_eos
    tokens = out.sequences[:, prompt_len:]
    raw = torch.stack(out.logits, dim=1).float()                      # [prompts, tokens, vocab], before suppression
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    tolerance = logit_tolerance(model, model_f64, out.sequences.tolist())
    refs = [GreedyReference(tokens[i].tolist(), chosen[i].tolist(), choices(raw[i], greedy, None, eos, tolerance))
            for i in range(len(prompt_ids))]
    assert_mostly_clear([r.choices for r in refs], "transformers' greedy tokens")
    return HFGreedy(refs, tolerance)


def num_clear_greedy(top_logprobs: list[list[float]], tolerance: float) -> int:
    """How many leading greedy tokens no run within the tolerance could choose otherwise: a logprob gap
    between the best two tokens is their logit gap, and each logit may move by the tolerance."""
    for i, top in enumerate(top_logprobs):
        best = sorted(top, reverse=True)
        if len(best) < 2 or best[0] - best[1] <= 2 * tolerance:   # (two tokens of one text share a key)
            return i
    return len(top_logprobs)


def assert_greedy_text(got: str, want: str, want_token_texts: list[str], num_clear: int) -> None:
    """`got` is `want`, or, when rounding could decide the greedy token at position `num_clear`, starts with
    the text of the tokens before it."""
    if num_clear == len(want_token_texts):
        assert got == want
    else:
        assert got.startswith("".join(want_token_texts[:num_clear]).rstrip("\ufffd")), (got, want, num_clear)
