"""A worker process started with `--speculative ngram`: stop strings that land inside an accepted run of
drafts cut the text where plain decoding cuts it, the counters reach /metrics and /load, a request can
turn speculation off, and a bad value of the switch is a clear 400."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from backends.core.sampling_params import SamplingParams
from tests.backends.numerics import assert_same_tokens, choices, logit_tolerance, teacher_forced_logits
from tests.support.worker_proc import worker_process

PROMPT = ('Rewrite this JSON with "age" set to 31. Output only the JSON.\n'
          '{"name": "Alice Smith", "age": 30, "email": "alice@example.com", "city": "Springfield", '
          '"tags": ["admin", "editor"]}\n')


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # K drafts every step: the adaptive K reads wall-clock step times, so what it drafts depends on the load
    args = ["--threads", "1", "--num-blocks", "64", "--speculative", "ngram", "--num-speculative-tokens", "5",
            "--no-adaptive-speculation"]
    with worker_process(args, log_dir=tmp_path_factory.mktemp("spec-worker")) as url:
        yield url


def complete(url: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": PROMPT, "temperature": 0.0,
                                                          "return_token_ids": True, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def counters(url: str) -> tuple[int, int]:
    load = httpx.get(f"{url}/load").json()
    return load["num_spec_proposed_tokens"], load["num_spec_accepted_tokens"]


def test_stop_string_inside_an_accepted_run(worker: str, smollm2_dir: Path, hf_smollm2: torch.nn.Module,
                                           hf_smollm2_f64: torch.nn.Module) -> None:
    from transformers import AutoTokenizer

    plain = complete(worker, max_tokens=48, speculative=False)["choices"][0]
    prompt_ids = AutoTokenizer.from_pretrained(str(smollm2_dir))(PROMPT)["input_ids"]
    ids = plain["token_ids"]
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [prompt_ids + ids])
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    reference = choices(teacher_forced_logits(hf_smollm2, prompt_ids, ids), greedy, None, (2,), tolerance, prompt_ids)
    before = counters(worker)
    fast = complete(worker, max_tokens=48)["choices"][0]
    assert counters(worker)[1] > before[1], "no draft was accepted"
    if not assert_same_tokens(fast["token_ids"], ids, reference, "with drafts against without"):
        return   # parted where rounding decides: the texts need not match past it
    assert fast["text"] == plain["text"]
    # Stop strings from the copied part of the answer: drafts were accepted across them.
    text = plain["text"]
    stops = [stop for stop in ('"city"', "Springfield", '"admin"', '"email"') if stop in text]
    assert stops, f"the answer copies none of the JSON: {text!r}"
    for stop in stops:
        cut_plain = complete(worker, max_tokens=48, stop=[stop], speculative=False)["choices"][0]
        cut_fast = complete(worker, max_tokens=48, stop=[stop])["choices"][0]
        assert cut_plain["text"] == text[:text.index(stop)]
        assert cut_fast["text"] == cut_plain["text"], stop
        assert cut_fast["finish_reason"] == cut_plain["finish_reason"] == "stop"


def test_logit_bias_binds_the_drafts_too(worker: str, smollm2_dir: Path, hf_smollm2: torch.nn.Module,
                                        hf_smollm2_f64: torch.nn.Module) -> None:
    """A word of the copied JSON banned by logit_bias: prompt lookup keeps drafting it (the prompt has it), and
    verification must refuse it as plain decoding does, so the answers with and without drafts agree and
    neither has it. Checked against transformers' logits with the same bias."""
    from transformers import AutoTokenizer

    unbiased = complete(worker, max_tokens=48, speculative=False)["choices"][0]["token_ids"]
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    # A word of a value the answer copies from the prompt ("Alice Smith", "Springfield", ...): drafted there.
    copied = {"Alice", "Smith", "alice", "Spring", "field", "admin", "editor"}
    banned = next((t for t in unbiased if tokenizer.decode([t]).strip() in copied and t in prompt_ids), None)
    assert banned is not None, tokenizer.decode(unbiased)
    bias = {str(banned): -100}
    plain = complete(worker, max_tokens=48, speculative=False, logit_bias=bias)["choices"][0]
    before = counters(worker)
    fast = complete(worker, max_tokens=48, logit_bias=bias)["choices"][0]
    assert counters(worker)[1] > before[1], "no draft was accepted"
    assert banned not in plain["token_ids"] and banned not in fast["token_ids"]
    ids = plain["token_ids"]
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [prompt_ids + ids])
    params = SamplingParams(max_tokens=48, temperature=0.0, logit_bias=((banned, -100.0),))
    reference = choices(teacher_forced_logits(hf_smollm2, prompt_ids, ids), params, None, (2,), tolerance, prompt_ids)
    assert_same_tokens(ids, ids, reference, "the plain answer against transformers' logits")
    assert_same_tokens(fast["token_ids"], ids, reference, "with drafts against without")


def test_counters_in_metrics_and_load_and_the_switch(worker: str) -> None:
    complete(worker, max_tokens=24)
    metrics = httpx.get(f"{worker}/metrics").text
    proposed = [line for line in metrics.splitlines()
                if line.startswith('switchyard_spec_proposed_tokens_total{proposer="ngram"}')]
    assert proposed and float(proposed[0].split()[-1]) > 0, metrics
    assert 'switchyard_spec_acceptance_rate{proposer="ngram"}' in metrics
    before = counters(worker)
    complete(worker, max_tokens=24, speculative=False)
    assert counters(worker) == before, "a request that turned speculation off ran drafts"
    bad = httpx.post(f"{worker}/v1/completions", json={"model": "smollm2", "prompt": "x", "speculative": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative", bad.text
