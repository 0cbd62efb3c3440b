"""The draft-model proposer and `switchyard make-draft` on the bundled SmolLM2.

make-draft's folder against transformers' forward of the same folder; the proposer, with the target as
its own draft, against transformers' greedy `generate` (tokens compared up to the first position float32
rounding could flip, tests/backends/numerics.py), after rejected drafts, under a small pool and a small
catch-up budget; its blocks all come back.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from backends.core.batch import ForwardBatch, SeqChunk
from backends.core.sampling_params import SamplingParams
from backends.speculative.draft import DraftModelProposer, weight_bytes_per_token
from backends.speculative.proposer import DraftRequest
from backends.worker.model_runner import ModelRunner
from tests.backends.numerics import (
    Choice,
    assert_mostly_clear,
    assert_same_tokens,
    choices,
    float64_copy,
    logit_tolerance,
    teacher_forced_logits,
)
from tests.support.worker_proc import worker_process
from tools.draft_training.make_draft import make_draft, select_layers

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ("The capital of France is Paris. The capital of Germany is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n",
           '{"name": "Ada", "city": "London", "age": 36} as YAML:\n')
NUM_DRAFTS = 10


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    return [tokenizer(text).input_ids for text in PROMPTS]


@pytest.fixture(scope="module")
def tolerance(hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module, prompts: list[list[int]]) -> float:
    return logit_tolerance(hf_smollm2, hf_smollm2_f64, prompts)


@pytest.fixture(scope="module")
def self_draft(smollm2_dir: Path, hf_smollm2: torch.nn.Module) -> DraftModelProposer:
    """The target as its own draft: its drafts are the target's greedy tokens."""
    target_bytes = 537_000_000
    return DraftModelProposer(smollm2_dir, target_bytes_per_token=target_bytes, dtype=torch.float32,
                              device="cpu", num_blocks=32)


def greedy(model: torch.nn.Module, tokens: Sequence[int], num_tokens: int,
           tolerance: float) -> tuple[list[int], list[Choice]]:
    """transformers' greedy continuation of `tokens` (shorter if it ends in EOS) and, for each of its tokens,
    whether rounding could flip it."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([list(tokens)]), max_new_tokens=num_tokens,
                             do_sample=False)[0, len(tokens):].tolist()
    logits = teacher_forced_logits(model, tokens, out)
    return out, choices(logits, GREEDY, None, (), tolerance)


def assert_drafts(got: list[int], want: list[int], reference: list[Choice], what: str) -> None:
    """Drafts run on past EOS where transformers stopped: compared over the reference's length."""
    assert_same_tokens(got[:len(want)], want, reference, what)


def assert_all_freed(proposer: DraftModelProposer, request_ids: Sequence[str]) -> None:
    for request_id in request_ids:
        proposer.free(request_id)
        proposer.free(request_id)   # idempotent
    proposer.blocks.check_invariants()
    assert proposer.num_requests == 0
    assert proposer.blocks.num_used_blocks == 0


# --- make-draft ---------------------------------------------------------------------------------

def test_select_layers() -> None:
    assert select_layers(30, 4) == [0, 1, 2, 3]
    assert select_layers(30, 4, tail=1) == [0, 1, 2, 29]
    assert select_layers(30, 30) == list(range(30))
    for keep, tail in ((0, 0), (31, 0), (4, 4), (4, -1)):
        with pytest.raises(ValueError):
            select_layers(30, keep, tail)


def test_make_draft_loads_in_transformers_and_ours_alike(smollm2_dir: Path, hf_smollm2: torch.nn.Module,
                                                         prompts: list[list[int]], tmp_path: Path) -> None:
    folder = tmp_path / "draft"
    assert make_draft(smollm2_dir, folder, keep=3, tail=1) == [0, 1, 29]
    reference = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert len(reference.model.layers) == 3
    target = hf_smollm2.model
    kept = (target.layers[0], target.layers[1], target.layers[29])
    for ours, theirs in zip(reference.model.layers, kept, strict=True):
        assert torch.equal(ours.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(ours.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight)
    assert torch.equal(reference.lm_head.weight, hf_smollm2.lm_head.weight)
    assert torch.equal(reference.model.norm.weight, target.norm.weight)
    assert AutoTokenizer.from_pretrained(str(folder))("hello").input_ids == \
        AutoTokenizer.from_pretrained(str(smollm2_dir))("hello").input_ids

    tolerance = logit_tolerance(reference, float64_copy(reference), prompts)
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=8)
    tokens = prompts[0]
    want = teacher_forced_logits(reference, tokens[:1], tokens[1:])   # [len - 1, vocab]: after each prefix
    table = tuple(range(8))
    split = len(tokens) // 2   # a prefill chunk, then token by token
    got = [runner.execute(ForwardBatch((SeqChunk(tuple(tokens[:split]), 0, table),)))[0]]
    for pos in range(split, len(tokens) - 1):
        got.append(runner.execute(ForwardBatch((SeqChunk((tokens[pos],), pos, table),)))[0])
    deviation = (torch.stack(got) - want[split - 1:]).abs().max().item()
    assert deviation <= tolerance, (deviation, tolerance)


def test_make_draft_command(tmp_path: Path) -> None:
    folder = tmp_path / "d2"
    run = subprocess.run([sys.executable, "-m", "gateway.cli", "make-draft", "--layers", "2", "--out", str(folder)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=2)
    assert len(runner.model.layers) == 2
    again = subprocess.run([sys.executable, "-m", "gateway.cli", "make-draft", "--layers", "2", "--out", str(folder)],
                           capture_output=True, text=True, check=False)
    assert again.returncode == 2 and "exists" in again.stderr
    bad = subprocess.run([sys.executable, "-m", "gateway.cli", "make-draft", "--layers", "99",
                          "--out", str(tmp_path / "d99")], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "--layers must be within 1..30" in bad.stderr
    assert not (tmp_path / "d99").exists()


# --- the proposer -------------------------------------------------------------------------------

def test_cost_per_token_is_the_ratio_of_weight_bytes(self_draft: DraftModelProposer, tmp_path: Path,
                                                     smollm2_dir: Path) -> None:
    target_bytes = weight_bytes_per_token(self_draft.runner.model, torch.float32)
    assert 500e6 < target_bytes < 560e6   # SmolLM2-135M in float32: 30 layers and the tied 49152 x 576 head
    make_draft(smollm2_dir, tmp_path / "d4", keep=4)
    draft = DraftModelProposer(tmp_path / "d4", target_bytes_per_token=target_bytes, dtype=torch.float32,
                               device="cpu", num_blocks=2)
    head = 49152 * 576 * 4
    assert draft.cost_per_token == pytest.approx((head + 4 / 30 * (target_bytes - head)) / target_bytes)


def test_target_as_draft_proposes_its_greedy_continuation(self_draft: DraftModelProposer, hf_smollm2: torch.nn.Module,
                                                          prompts: list[list[int]], tolerance: float) -> None:
    wanted = [NUM_DRAFTS, 3, 7]   # each request stops at its own count, in one batch
    references = [greedy(hf_smollm2, p, NUM_DRAFTS, tolerance) for p in prompts]
    assert_mostly_clear([ref for _, ref in references], "greedy references")
    got = self_draft.propose([DraftRequest(f"r{i}", p, n)
                              for i, (p, n) in enumerate(zip(prompts, wanted, strict=True))])
    for i, ((want, ref), n) in enumerate(zip(references, wanted, strict=True)):
        assert len(got[i]) == n
        assert_drafts(got[i], want[:n], ref[:n], f"prompt {i}")
    assert_all_freed(self_draft, [f"r{i}" for i in range(len(prompts))])


def test_recovers_after_rejected_drafts(self_draft: DraftModelProposer, hf_smollm2: torch.nn.Module,
                                        prompts: list[list[int]], tolerance: float) -> None:
    """Step by step as the engine calls it: the first draft accepted and a correction unlike the second,
    then every draft accepted plus the target's next token, then a restart shorter than what the draft's
    cache holds. Each step's drafts must be the greedy continuation of the tokens given, whatever the
    cache held before."""
    prompt, k = prompts[0], 4
    first = self_draft.propose([DraftRequest("a", prompt, k)])[0]
    tokens = [*prompt, first[0], (first[1] + 1) % 1000]
    want, ref = greedy(hf_smollm2, tokens, k + 1, tolerance)
    got = self_draft.propose([DraftRequest("a", tokens, k)])[0]
    assert_drafts(got, want[:k], ref[:k], "after a rejected draft")
    tokens += want   # the k drafts (as the target would have them) and the bonus token
    want, ref = greedy(hf_smollm2, tokens, k, tolerance)
    got = self_draft.propose([DraftRequest("a", tokens, k)])[0]
    assert_drafts(got, want, ref, "after all were accepted")
    self_draft.blocks.check_invariants()

    short = [*prompt[:-1], (prompt[-1] + 1) % 1000]
    want, ref = greedy(hf_smollm2, short, k, tolerance)
    got = self_draft.propose([DraftRequest("a", short, k)])[0]
    assert_drafts(got, want, ref, "restarted shorter")
    # Only the common prefix was kept, and the blocks past it went back to the pool.
    assert self_draft.blocks.num_used_blocks == self_draft.blocks.blocks_needed(len(short) + k - 1)
    assert_all_freed(self_draft, ["a"])


def test_full_pool_gives_no_drafts(smollm2_dir: Path, hf_smollm2: torch.nn.Module, prompts: list[list[int]],
                                   tolerance: float) -> None:
    proposer = DraftModelProposer(smollm2_dir, target_bytes_per_token=537_000_000, dtype=torch.float32,
                                  device="cpu", num_blocks=2, block_size=16)   # 32 tokens
    long = (prompts[1] * 4)[:40]
    got = proposer.propose([DraftRequest("long", long, 4), DraftRequest("short", prompts[0], 4)])
    assert got[0] == []
    want, ref = greedy(hf_smollm2, prompts[0], 4, tolerance)
    assert_drafts(got[1], want, ref, "short beside a long one that does not fit")
    # One draft fits where four do not: the short prompt fills its block table to the last slot.
    edge = (prompts[2] * 4)[:32]
    proposer.free("short")
    got = proposer.propose([DraftRequest("edge", edge, 4)])
    assert len(got[0]) == 1
    assert_all_freed(proposer, ["long", "short", "edge"])


def test_long_prompt_caught_up_across_steps(smollm2_dir: Path, hf_smollm2: torch.nn.Module,
                                            prompts: list[list[int]], tolerance: float) -> None:
    proposer = DraftModelProposer(smollm2_dir, target_bytes_per_token=537_000_000, dtype=torch.float32,
                                  device="cpu", num_blocks=8, max_catchup_tokens=8)
    prompt = prompts[1]   # 20-odd tokens: three steps of 8
    steps = 0
    while not (got := proposer.propose([DraftRequest("p", prompt, 3)])[0]):
        steps += 1
        assert steps < 10
    assert steps == -(-len(prompt) // 8) - 1
    want, ref = greedy(hf_smollm2, prompt, 3, tolerance)
    assert_drafts(got, want, ref, "after catching up")
    assert_all_freed(proposer, ["p"])


# --- in a worker --------------------------------------------------------------------------------

def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def spec_counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(f'switchyard_{name}_total{{proposer="draft"}}'))


def test_worker_with_a_draft_model_gives_the_targets_greedy_tokens(smollm2_dir: Path, hf_smollm2: torch.nn.Module,
                                                                    prompts: list[list[int]], tolerance: float,
                                                                    tmp_path: Path) -> None:
    """`--speculative draft` end to end: concurrent greedy requests, drafts from a 28-layer cut of the
    target (K fixed at 4; about half of its drafts are accepted: docs/benchmarks.md), each output against transformers'
    greedy tokens with EOS banned (as ignore_eos does)."""
    make_draft(smollm2_dir, tmp_path / "d28", keep=28)
    num_tokens = 24
    ignore_eos = SamplingParams(temperature=0.0, ignore_eos=True)
    eos = hf_smollm2.generation_config.eos_token_id
    hf_smollm2.generation_config.eos_token_id = None
    try:
        with torch.inference_mode():
            wants = [hf_smollm2.generate(torch.tensor([p]), max_new_tokens=num_tokens, do_sample=False,
                                         suppress_tokens=[2])[0, len(p):].tolist() for p in prompts]
    finally:
        hf_smollm2.generation_config.eos_token_id = eos
    refs = [choices(teacher_forced_logits(hf_smollm2, p, w), ignore_eos, None, (2,), tolerance)
            for p, w in zip(prompts, wants, strict=True)]
    assert_mostly_clear(refs, "transformers' greedy tokens")
    args = ["--speculative", "draft", "--speculative-model", str(tmp_path / "d28"), "--num-speculative-tokens", "4",
            "--no-adaptive-speculation"]
    with worker_process(args) as url, ThreadPoolExecutor(len(prompts) * 2) as pool:
        outs = list(pool.map(lambda p: complete(url, p, num_tokens), prompts * 2))
        proposed, accepted = spec_counter(url, "spec_proposed_tokens"), spec_counter(url, "spec_accepted_tokens")
    for i, got in enumerate(outs):
        assert_same_tokens(got, wants[i % len(prompts)], refs[i % len(prompts)], f"request {i}")
    assert 0 < accepted < proposed, (accepted, proposed)


# --- behind prompt lookup (`--speculative ngram+draft`) ----------------------------------------------

def test_engine_greedy_with_lookup_then_a_draft_model_equals_plain_decoding(tmp_path: Path, smollm2_dir: Path,
                                                                            hf_smollm2, hf_smollm2_f64) -> None:
    """Concurrent structured prompts (made to be copied), K = 3 every step: prompt lookup drafts where it finds
    a match, a 12-layer cut of the target everywhere else, and the tokens are plain decoding's, judged against
    transformers where float32 rounding cannot decide. Both proposers drafted, and the draft model's blocks all
    came back once the requests ended."""
    from backends.core.engine_config import EngineConfig
    from backends.engine.engine import LLMEngine
    from backends.speculative.lookup_first import LookupFirstProposer
    from backends.speculative.ngram import NgramProposer
    from tests.backends.engine.runner_view import RunnerView
    from tests.backends.engine.test_engine_model import make_engine, run_all, tokens
    from tests.backends.engine.test_speculative import STRUCTURED, greedy_reference

    make_draft(smollm2_dir, tmp_path / "d12", keep=12)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = {f"s{i}": tokenizer(text)["input_ids"] for i, text in enumerate(STRUCTURED)}
    params = SamplingParams(max_tokens=24, temperature=0.0)
    runner = ModelRunner(smollm2_dir, dtype=torch.float32, device="cpu", num_blocks=96, block_size=16)
    draft = DraftModelProposer(tmp_path / "d12", target_bytes_per_token=537_000_000, dtype=torch.float32,
                               device="cpu", num_blocks=96)
    both = LookupFirstProposer(draft, NgramProposer())
    plain, _ = make_engine(runner, smollm2_dir, 96, enable_prefix_caching=False)
    fast = LLMEngine(EngineConfig(model_dir=str(smollm2_dir), num_blocks=96, speculative=both.name,
                                  speculative_model=str(tmp_path / "d12"), spec_adaptive=False,
                                  num_speculative_tokens=3, enable_prefix_caching=False),
                     RunnerView(runner, 96), smollm2_dir, proposer=both)
    outs = []
    for engine in (plain, fast):
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
        outs.append(run_all(engine))
    want, got = outs
    refs, _ = greedy_reference(hf_smollm2, hf_smollm2_f64, list(prompts.values()),
                               [tokens(want[r]) for r in prompts], plain.eos_token_ids, params)
    for rid, ref in zip(prompts, refs, strict=True):
        assert_same_tokens(tokens(got[rid]), tokens(want[rid]), ref, rid)
    stats = fast.stats()
    assert stats.speculative == "ngram+draft" and stats.num_spec_proposed_tokens > 0, stats
    assert both.num_lookup_drafts > 0 and both.num_model_drafts > 0, (both.num_lookup_drafts, both.num_model_drafts)
    assert draft.num_requests == 0
    draft.blocks.check_invariants()
    assert draft.blocks.num_used_blocks == 0
