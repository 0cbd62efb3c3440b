"""LLMEngine on the real bundled model (SmolLM2-135M, fp32, CPU) against transformers:
prefix-cache hits and preemption/recompute must not change logits or greedy tokens, and seeded
sampling must not depend on the batch. Tokens from two different computations are compared where
float32 rounding cannot decide them (tests/backends/numerics.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from backends.core.block_events import KVEventKind
from backends.core.engine_config import EngineConfig
from backends.core.outputs import FinishReason
from backends.core.sampling_params import SamplingParams
from backends.engine.engine import LLMEngine
from backends.worker.model_runner import ModelRunner
from cache.block_hash import block_hashes
from tests.backends.engine.runner_view import RunnerView
from tests.backends.numerics import assert_mostly_clear, assert_same_tokens, choices, logit_tolerance

BLOCK = 16


def make_engine(runner: ModelRunner, model_dir: Path, num_blocks: int, **kw: object
                ) -> tuple[LLMEngine, RunnerView]:
    view = RunnerView(runner, num_blocks)
    config = EngineConfig(model_dir=str(model_dir), block_size=BLOCK, num_blocks=num_blocks, **kw)
    return LLMEngine(config, view, model_dir), view


def run_all(engine: LLMEngine, max_steps: int = 500) -> dict[str, list]:
    """Step until idle; the outputs of each request, in order."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def test_prefix_cache_hit_logits_match_transformers(smollm2_runner: ModelRunner, smollm2_dir: Path,
                                                     hf_smollm2: torch.nn.Module) -> None:
    engine, runner = make_engine(smollm2_runner, smollm2_dir, num_blocks=64)
    shared = prompt(1, 2 * BLOCK)
    first, second = shared + prompt(2, 7), shared + prompt(3, 5)
    engine.add_request("a", first, SamplingParams(max_tokens=1, temperature=0.0))
    out_a = run_all(engine)["a"]
    engine.add_request("b", second, SamplingParams(max_tokens=1, temperature=0.0))
    n_steps = len(runner.steps)
    out_b = run_all(engine)["b"]
    assert out_a[-1].num_cached_tokens == 0
    assert out_b[-1].num_cached_tokens == 2 * BLOCK
    batch, logits = runner.steps[n_steps]
    assert batch.chunks[0].num_context_tokens == 2 * BLOCK and len(batch.chunks[0].token_ids) == 5
    with torch.inference_mode():
        ref = hf_smollm2(torch.tensor([second])).logits[0, -1].float()
    assert rel_err(logits[0], ref) < 1e-4
    assert engine.stats().num_cached_prompt_tokens == 2 * BLOCK
    # KV events name the two shared blocks, chained as the gateway computes them.
    stored = [e.block_hash for e in engine.kv_events.since(0).events if e.kind is KVEventKind.STORED]
    assert stored[:2] == block_hashes(first, BLOCK)[:2]


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], n: int, eos: tuple[int, ...]
              ) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy generate for equal-length prompts in one batch, cut after the first EOS:
    each row's tokens and the logits [tokens, vocab] they were chosen from."""
    with torch.inference_mode():
        out = model.generate(torch.tensor(prompts), max_new_tokens=n, do_sample=False, eos_token_id=list(eos),
                             pad_token_id=eos[0], output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1).float()                     # [rows, steps, vocab]
    cut = []
    for i, row in enumerate(out.sequences[:, len(prompts[0]):].tolist()):
        ends = [j for j, t in enumerate(row) if t in eos]
        row = row[:ends[0] + 1] if ends else row
        cut.append((row, logits[i, :len(row)]))
    return cut


def test_preemption_recompute_keeps_greedy_tokens(smollm2_runner: ModelRunner, smollm2_dir: Path,
                                                  hf_smollm2: torch.nn.Module,
                                                  hf_smollm2_f64: torch.nn.Module) -> None:
    # 3 sequences of 20 + 14 tokens (3 blocks each at the end) in 7 blocks: someone is preempted.
    engine, _ = make_engine(smollm2_runner, smollm2_dir, num_blocks=7)
    prompts = {f"p{i}": prompt(10 + i, 20) for i in range(3)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=14, temperature=0.0))
    outs = run_all(engine)
    assert engine.stats().num_preemptions > 0
    expected = hf_greedy(hf_smollm2, list(prompts.values()), 14, engine.eos_token_ids)
    rows = [p + ref for p, (ref, _) in zip(prompts.values(), expected, strict=True)]
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, rows)
    greedy = SamplingParams(max_tokens=14, temperature=0.0)
    refs = [choices(logits, greedy, None, engine.eos_token_ids, tolerance) for _, logits in expected]
    assert_mostly_clear(refs, "transformers' greedy tokens")
    for rid, (ref, _), reference in zip(prompts, expected, refs, strict=True):
        assert_same_tokens(tokens(outs[rid]), ref, reference, rid)
    assert engine.block_manager.num_free_blocks == 7


def test_seeded_sampling_same_alone_and_in_a_busy_batch(smollm2_runner: ModelRunner, smollm2_dir: Path,
                                                         hf_smollm2: torch.nn.Module,
                                                         hf_smollm2_f64: torch.nn.Module) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=20, seed=1234, ignore_eos=True)
    target = prompt(20, 25)
    engine, view = make_engine(smollm2_runner, smollm2_dir, num_blocks=64, max_num_batched_tokens=32)
    engine.add_request("alone", target, params)
    alone = tokens(run_all(engine)["alone"])
    alone_logits = torch.cat([logits for _, logits in view.steps])   # one sequence: a row per token drawn
    assert alone_logits.shape[0] == len(alone)
    # Busy: others arrive first (a long prefill is chunked alongside), with different knobs.
    engine.add_request("g", prompt(21, 12), SamplingParams(max_tokens=10, temperature=0.0))
    engine.add_request("s", prompt(22, 60), SamplingParams(max_tokens=10, temperature=1.2, top_k=50))
    engine.step()
    engine.add_request("busy", target, params)
    engine.add_request("u", prompt(23, 6), SamplingParams(max_tokens=10, temperature=0.7))
    outs = run_all(engine)
    # Other rows beside it change how its logits round, not the draw: compared where rounding cannot decide.
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [target + alone])
    reference = choices(alone_logits, params, params.seed, engine.eos_token_ids, tolerance, target)
    assert_mostly_clear([reference], "the sequence's draws alone")
    assert_same_tokens(tokens(outs["busy"]), alone, reference, "busy against alone")
    assert outs["busy"][-1].finish_reason is FinishReason.LENGTH and outs["busy"][-1].num_cached_tokens == 16
