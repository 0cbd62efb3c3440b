"""Mixtral and Qwen3-MoE (tiny random checkpoints saved by transformers) through our runner and engine against
transformers' own forward and `generate` on the same weights, in float32: logits within the rounding measured in
the same run (tests/backends/numerics.py), greedy tokens equal where rounding cannot decide them. Paged prefill
in uneven chunks, token-by-token decode, a mixed batch over shuffled block tables, a prefix-cache hit against a
cold run, chunked prefill beside decodes and n-gram speculation in the engine."""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from backends.core.batch import ForwardBatch, SeqChunk
from backends.core.engine_config import EngineConfig
from backends.core.sampling_params import SamplingParams
from backends.engine.engine import LLMEngine
from backends.models import model_class
from backends.models.kernels.registry import select_kernels
from backends.models.moe import MoEBlock
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView
from tests.backends.engine.test_engine_model import hf_greedy, run_all, tokens
from tests.backends.models.moe_checkpoints import TINY_MOE, float64_twin, tiny_moe
from tests.backends.numerics import assert_mostly_clear, assert_same_tokens, choices, logit_tolerance
from tests.backends.test_model_forward import shuffled_table

BLOCK = 4


@dataclass(frozen=True)
class Moe:
    folder: Path
    runner: ModelRunner
    hf: torch.nn.Module           # transformers' model, float32
    tolerance: float              # |logit| deviation two float32 evaluations may show (numerics.logit_tolerance)

    def prompt(self, seed: int, length: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(3, self.runner.vocab_size) for _ in range(length)]

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.hf(torch.tensor([ids])).logits[0].float()   # [len(ids), vocab]

    def assert_close(self, ours: torch.Tensor, ref: torch.Tensor, what: object) -> None:
        assert (ours.float() - ref).abs().max().item() < self.tolerance, what


@pytest.fixture(scope="module", params=sorted(TINY_MOE))
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Moe:
    folder = tmp_path_factory.mktemp(request.param)
    hf = tiny_moe(request.param, folder)
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=96, block_size=BLOCK)
    rows = [Moe(folder, runner, hf, 0.0).prompt(seed, 40) for seed in range(3)]
    return Moe(folder, runner, hf, logit_tolerance(hf, float64_twin(hf), rows))


def test_prefill_in_chunks_and_decode_match_transformers(moe: Moe) -> None:
    rng, free = random.Random(1), list(range(moe.runner.num_blocks))
    ids = moe.prompt(0, 40)   # a row the tolerance was measured on
    ref = moe.logits(ids)
    blocks = -(-len(ids) // BLOCK)
    whole = moe.runner.execute(ForwardBatch((SeqChunk(tuple(ids), 0, shuffled_table(rng, free, blocks)),)))
    moe.assert_close(whole[0], ref[-1], "whole prefill")
    table = shuffled_table(rng, free, blocks)
    for start, end in itertools.pairwise([0, 13, 27, 40]):
        out = moe.runner.execute(ForwardBatch((SeqChunk(tuple(ids[start:end]), start, table),)))
        moe.assert_close(out[0], ref[end - 1], ("chunk", start, end))
    table = shuffled_table(rng, free, blocks)
    moe.runner.execute(ForwardBatch((SeqChunk(tuple(ids[:30]), 0, table, want_logits=False),)))
    for pos in range(30, 40):
        out = moe.runner.execute(ForwardBatch((SeqChunk((ids[pos],), pos, table),)))
        moe.assert_close(out[0], ref[pos], ("decode", pos))


def test_a_mixed_batch_matches_transformers(moe: Moe) -> None:
    """A prefills its second chunk while B and C decode, in one step; the experts see all their tokens at once."""
    rng, free = random.Random(2), list(range(moe.runner.num_blocks))
    a, b, c = (moe.prompt(seed, 40) for seed in range(3))
    tables = [shuffled_table(rng, free, 40 // BLOCK) for _ in range(3)]
    moe.runner.execute(ForwardBatch((SeqChunk(tuple(a[:17]), 0, tables[0], want_logits=False),
                                     SeqChunk(tuple(b[:-1]), 0, tables[1], want_logits=False),
                                     SeqChunk(tuple(c[:-1]), 0, tables[2], want_logits=False))))
    out = moe.runner.execute(ForwardBatch((SeqChunk((b[-1],), 39, tables[1]), SeqChunk(tuple(a[17:]), 17, tables[0]),
                                           SeqChunk((c[-1],), 39, tables[2]))))
    for row, seq in enumerate((b, a, c)):
        moe.assert_close(out[row], moe.logits(seq)[-1], row)


def test_transformers_fused_expert_layout_loads_the_same_weights(moe: Moe) -> None:
    """transformers 5 keeps experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H]); its state_dict loads
    into our model as the per-expert checkpoint it saved does: every block gives the same output."""
    model = model_class(moe.runner.config.architectures)(moe.runner.config, select_kernels("cpu"))
    state = moe.hf.state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    with torch.no_grad():
        model.load_weights(state)
    x = torch.randn(9, moe.runner.config.hidden_size)
    blocks = [(mine.mlp, theirs.mlp) for mine, theirs in zip(model.layers, moe.runner.model.layers, strict=True)]
    assert any(isinstance(mine, MoEBlock) for mine, _ in blocks)
    with torch.inference_mode():
        for mine, theirs in blocks:
            assert torch.equal(mine(x), theirs(x))


def engine(moe: Moe, **kw: object) -> tuple[LLMEngine, RunnerView]:
    view = RunnerView(moe.runner)
    config = EngineConfig(model_dir=str(moe.folder), block_size=BLOCK, num_blocks=view.num_blocks, **kw)
    return LLMEngine(config, view, moe.folder), view


def test_greedy_tokens_with_chunked_prefill_beside_decodes_equal_transformers_generate(moe: Moe) -> None:
    """Three prompts admitted together under a budget of 16 tokens a step: prefills go in chunks beside the
    others' decodes (continuous batching); each sequence's tokens are transformers' greedy ones."""
    eng, view = engine(moe, max_num_batched_tokens=16)
    prompts = {f"r{i}": moe.prompt(10 + i, 30) for i in range(3)}
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    outs = run_all(eng)
    assert any(len(b.chunks) > 1 and any(len(c.token_ids) > 1 for c in b.chunks)
               and any(len(c.token_ids) == 1 for c in b.chunks) for b, _ in view.steps), "no mixed step"
    expected = hf_greedy(moe.hf, list(prompts.values()), 10, (-1,))
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    refs = [choices(logits, greedy, None, (), moe.tolerance) for _, logits in expected]
    assert_mostly_clear(refs, "transformers' greedy tokens")
    for rid, (want, _), reference in zip(prompts, expected, refs, strict=True):
        assert_same_tokens(tokens(outs[rid]), want, reference, rid)
    eng.close()


def test_a_prefix_cache_hit_gives_a_cold_runs_logits_and_tokens(moe: Moe) -> None:
    shared = moe.prompt(20, 6 * BLOCK)
    first, second = shared + moe.prompt(21, 5), shared + moe.prompt(22, 7)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        eng, view = engine(moe, enable_prefix_caching=caching)
        eng.add_request("first", first, params)
        run_all(eng)
        start = len(view.steps)
        eng.add_request("second", second, params)
        out = run_all(eng)["second"]
        assert out[-1].num_cached_tokens == (len(shared) if caching else 0)
        runs[caching] = (tokens(out), view.steps[start][1][0])   # the prompt's last logits
        eng.close()
    (hit_ids, hit_logits), (cold_ids, cold_logits) = runs[True], runs[False]
    ref = moe.logits(second)[-1]
    moe.assert_close(hit_logits, ref, "hit against transformers")
    moe.assert_close(hit_logits, cold_logits, "hit against cold")
    (want, logits), = hf_greedy(moe.hf, [second], 6, (-1,))
    reference = choices(logits, params, None, (), moe.tolerance)
    assert_same_tokens(cold_ids, want, reference, "cold")
    assert_same_tokens(hit_ids, want, reference, "hit")


def test_ngram_speculation_keeps_transformers_greedy_tokens(moe: Moe) -> None:
    """Prompt lookup drafts several tokens a step; verifying them runs each sequence's drafts through the experts
    together. Prompts repeat a phrase so that lookups find drafts; the tokens stay transformers' greedy ones."""
    eng, view = engine(moe, speculative="ngram", num_speculative_tokens=4, spec_adaptive=False)
    prompts = {f"r{i}": (moe.prompt(30 + i, 6) * 4)[:22] for i in range(3)}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    outs = run_all(eng)
    assert any(c.num_logits > 1 for batch, _ in view.steps for c in batch.chunks), "no step verified drafts"
    expected = hf_greedy(moe.hf, list(prompts.values()), 16, (-1,))
    for rid, (want, logits) in zip(prompts, expected, strict=True):
        assert_same_tokens(tokens(outs[rid]), want, choices(logits, params, None, (), moe.tolerance), rid)
    assert eng.stats().num_spec_accepted_tokens > 0, eng.stats()
    eng.close()
