"""Speculative decoding with a model proposer over a group of ranks (gloo on the CPU, the tiny random Llama of
test_tensor_parallel_served.py): the proposer runs in rank 0 beside its shard (backends/speculative/factory.py).

- a draft model (the target's own layers, cut with `switchyard make-draft`) over a TP=2 group and over two
  pipeline stages;
- an EAGLE head over two pipeline stages (stage 0 holds the embedding and LM head it shares) and over a TP=2
  group (whose are split by vocabulary: rank 0 reads whole copies for the head, backends/speculative/vocabulary.py).

The groups' greedy tokens are transformers' and the single-rank worker's, and the group drafts as one rank with
the same proposer does: as many drafts proposed and accepted (the draft model's all accepted, the random EAGLE
head's none: that case shows the head runs and its drafts are verified over the stages, not what it proposes).
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.backends.executor.test_tensor_parallel_served import STORY, Served, hf_reference
from tests.backends.executor.tp_checkpoints import tiny_llama
from tests.backends.numerics import assert_same_tokens, float64_copy
from tests.backends.pd_http import assert_idle, get_text, post
from tests.backends.references import prompt_ids, smollm2_vocabulary
from tests.backends.speculative.test_eagle import write_head
from tests.support.worker_proc import WorkerProcess, started_workers
from tools.draft_training.make_draft import make_draft

pytestmark = pytest.mark.slow

NAME = "tiny-llama"
COMMON = ["--threads", "1", "--num-blocks", "64", "--served-model-name", NAME, "--num-speculative-tokens", "3",
          "--no-adaptive-speculation"]
GROUPS = {"tp2": ["--tensor-parallel-size", "2"], "pp2": ["--pipeline-parallel-size", "2"]}
CASES = [("draft", "tp2"), ("draft", "pp2"), ("eagle", "tp2"), ("eagle", "pp2")]   # (proposer, group)
BODY = {"model": NAME, "prompt": STORY, "max_tokens": 12, "temperature": 0.0, "return_token_ids": True,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, dict[str, WorkerProcess]]]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_llama(folder)
    proposers = {kind: tmp_path_factory.mktemp("proposers") / kind for kind in ("draft", "eagle")}
    make_draft(folder, proposers["draft"], keep=2)   # both its layers: its drafts are accepted
    # a random head: its drafts are rejected, so this checks that it runs and verifies, not what it proposes
    write_head(proposers["eagle"], folder, eagle1=False, fmt="safetensors", d2t=False)
    spec = {kind: ["--speculative", kind, "--speculative-model", str(path)] for kind, path in proposers.items()}
    args = {f"{kind}-tp1": ["--model", str(folder), *spec[kind], *COMMON] for kind in proposers}
    args |= {f"{kind}-{group}": ["--model", str(folder), *GROUPS[group], *spec[kind], *COMMON]
             for kind, group in CASES}
    with started_workers(args, tmp_path_factory.mktemp("spec-workers")) as workers:
        yield Served(folder, model, float64_copy(model), workers), workers


async def spec_counts(url: str, proposer: str) -> tuple[float, float]:
    """The worker's drafts proposed and accepted so far (its /metrics)."""
    text = await get_text(url + "/metrics")

    def counter(name: str) -> float:
        found = re.search(rf'^switchyard_{name}_total{{proposer="{proposer}"}} (\S+)$', text, re.MULTILINE)
        assert found, f"no {name} counter for {proposer}"
        return float(found.group(1))
    return counter("spec_proposed_tokens"), counter("spec_accepted_tokens")


@pytest.mark.parametrize(("proposer", "group"), CASES)
async def test_a_group_with_a_model_proposer_gives_one_ranks_tokens_and_drafts(
        served: tuple[Served, dict[str, WorkerProcess]], proposer: str, group: str) -> None:
    reference_model, workers = served
    tokenizer, _ = smollm2_vocabulary()
    prompt = prompt_ids(tokenizer, BODY, chat=False)
    want, reference = hf_reference(reference_model, prompt, BODY["max_tokens"])
    one, many = workers[f"{proposer}-tp1"].url, workers[f"{proposer}-{group}"].url
    before = {url: await spec_counts(url, proposer) for url in (one, many)}
    answers = {}
    for url in (one, many):
        status, body = await post(url, BODY)
        assert status == 200, body
        answers[url] = body["choices"][0]["token_ids"]
    assert_same_tokens(answers[one], want, reference, "one rank against transformers")
    assert answers[many] == answers[one]
    drafted = {url: tuple(now - then for now, then in zip(await spec_counts(url, proposer), before[url],
                                                            strict=True)) for url in (one, many)}
    assert drafted[many][0] > 0, drafted            # the group drafted
    assert drafted[many] == drafted[one], drafted   # and as one rank does
    await assert_idle([one, many])
