"""Embedding inputs in the engine, on the real bundled model: prefilled in chunks through the scheduler like
any prompt (prefix cache included), then pooled instead of sampled, against transformers' last hidden state;
in one step with decoding sequences, whose logits rows they leave alone; never shown to a speculative
proposer; their blocks free once they finish or are cancelled."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.core.batch import ForwardBatch
from backends.core.engine_config import EngineConfig
from backends.core.outputs import FinishReason, SequenceOutput
from backends.core.sampling_params import SamplingParams
from backends.engine.async_engine import AsyncEngine, EngineRequestError
from backends.engine.engine import LLMEngine
from backends.speculative.ngram import NgramProposer
from backends.speculative.proposer import DraftRequest
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView
from tests.backends.engine.test_engine_model import BLOCK, make_engine, prompt, run_all
from tests.backends.numerics import embedding_tolerance, last_token_embedding
from tests.support.wait import DEFAULT_TIMEOUT_S, await_until

BUDGET = 16   # tokens per step: a 70-token input runs in five chunks


def vector(out: SequenceOutput) -> torch.Tensor:
    assert out.embedding is not None, out
    return torch.from_numpy(np.frombuffer(out.embedding, dtype="<f4").copy()).double()


def assert_close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    assert torch.dot(got, want).item() >= 0.9999   # both unit vectors: the cosine
    assert (got - want).abs().max().item() <= tolerance


def assert_all_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished() and bm.num_free_blocks == bm.num_total_blocks, "blocks leaked"


def test_hidden_states_last_is_after_the_final_norm(hf_smollm2: torch.nn.Module) -> None:
    """The reference's premise: transformers' hidden_states[-1] is LlamaModel's output, its final norm applied."""
    ids = torch.tensor([prompt(9, 12)])
    with torch.inference_mode():
        recorded = hf_smollm2(ids, output_hidden_states=True).hidden_states[-1]
        normed = hf_smollm2.get_submodule("model")(ids).last_hidden_state
    assert torch.equal(recorded, normed)


def test_chunked_then_cached_embedding_matches_transformers(
        smollm2_runner: ModelRunner, smollm2_dir: Path, hf_smollm2: torch.nn.Module,
        hf_smollm2_f64: torch.nn.Module) -> None:
    engine, runner = make_engine(smollm2_runner, smollm2_dir, num_blocks=32, max_num_batched_tokens=BUDGET)
    ids = prompt(4, 70)
    want = last_token_embedding(hf_smollm2, ids)
    tolerance = embedding_tolerance(hf_smollm2, hf_smollm2_f64, [ids])
    engine.add_embedding("e", ids)
    first = run_all(engine)["e"]
    assert len(runner.steps) == 5 and all(logits.shape[0] == 0 for _, logits in runner.steps)   # never sampled
    assert [len(b.chunks[0].token_ids) for b, _ in runner.steps] == [16, 16, 16, 16, 6]
    assert len(first) == 1 and first[0].finish_reason is FinishReason.STOP and first[0].new_token_ids == ()
    assert (first[0].num_prompt_tokens, first[0].num_cached_tokens) == (70, 0)
    assert_close(vector(first[0]), want, tolerance)
    assert_all_free(engine)
    # Again: its four full blocks come from the prefix cache, and only the last six tokens run.
    engine.add_embedding("again", ids)
    again = run_all(engine)["again"][0]
    assert again.num_cached_tokens == 4 * BLOCK
    assert runner.steps[-1][0].chunks[0].num_context_tokens == 4 * BLOCK
    assert_close(vector(again), want, tolerance)
    stats = engine.stats()
    assert (stats.num_prompt_tokens, stats.num_cached_prompt_tokens, stats.num_generation_tokens) == (140, 64, 0)
    assert stats.num_finished_sequences == 2
    assert_all_free(engine)


def test_embedding_in_a_step_with_decodes(smollm2_runner: ModelRunner, smollm2_dir: Path,
                                          hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module) -> None:
    """A decoding sequence and embedding chunks share steps: logits are computed for the decode alone, and the
    decode's tokens equal those it samples alone."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone, _ = make_engine(smollm2_runner, smollm2_dir, num_blocks=64, max_num_batched_tokens=BUDGET)
    gen_prompt, inputs = prompt(5, 9), [prompt(6, 40), prompt(7, 3)]
    alone.add_request("g", gen_prompt, greedy)
    want_tokens = [t for o in run_all(alone)["g"] for t in o.new_token_ids]
    engine, runner = make_engine(smollm2_runner, smollm2_dir, num_blocks=64, max_num_batched_tokens=BUDGET)
    engine.add_request("g", gen_prompt, greedy)
    first = engine.step()   # the prompt and its first token: "g" decodes from here on
    for i, ids in enumerate(inputs):
        engine.add_embedding(f"e{i}", ids)
    outs = run_all(engine)
    outs["g"][:0] = first
    mixed = [(b, logits) for b, logits in runner.steps if len(b.chunks) > 1]
    assert mixed and all(logits.shape[0] == 1 and b.chunks[0].want_logits for b, logits in mixed)
    assert not any(c.want_logits for b, _ in mixed for c in b.chunks[1:])
    # Another batch rounds the decode's logits otherwise; its greedy margins here are far above that.
    assert [t for o in outs["g"] for t in o.new_token_ids] == want_tokens
    tolerance = embedding_tolerance(hf_smollm2, hf_smollm2_f64, inputs)
    for i, ids in enumerate(inputs):
        assert_close(vector(outs[f"e{i}"][0]), last_token_embedding(hf_smollm2, ids), tolerance)
    assert engine.load_report().num_decode_tokens_pending == 0
    assert_all_free(engine)


def test_a_proposer_never_sees_an_embedding(smollm2_runner: ModelRunner, smollm2_dir: Path) -> None:
    class Recording(NgramProposer):
        wants_hidden = True   # so that the engine hands it the target's hidden states too

        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
            self.seen.update(r.request_id for r in requests)
            return super().propose(requests)

        def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
            self.seen.add(request_id)

    proposer = Recording()
    engine = LLMEngine(EngineConfig(model_dir=str(smollm2_dir), num_blocks=64, max_num_batched_tokens=BUDGET),
                       RunnerView(smollm2_runner, 64), smollm2_dir, proposer=proposer)
    repetitive = [11, 12, 13, 14] * 10   # what prompt lookup would draft from, were it asked
    engine.add_request("g", repetitive[:12], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.add_embedding("e", repetitive)
    outs = run_all(engine)
    assert outs["e"][0].embedding is not None and "g" in proposer.seen and "e" not in proposer.seen
    assert_all_free(engine)


async def test_async_embed_fills_the_context_and_cancelling_frees_blocks(smollm2_runner: ModelRunner,
                                                                         smollm2_dir: Path) -> None:
    view = RunnerView(smollm2_runner, 32)
    config = EngineConfig(model_dir=str(smollm2_dir), num_blocks=32, max_model_len=64, max_num_batched_tokens=BUDGET,
                          torch_num_threads=2)
    engine = AsyncEngine(config, lambda c: LLMEngine(c, view, smollm2_dir))
    release = threading.Event()
    await engine.start()
    try:
        assert engine.hidden_size == 576
        with pytest.raises(EngineRequestError):   # a generation needs room for one output token ...
            engine.generate("g", prompt(1, 64), SamplingParams(max_tokens=1))
        out = await engine.embed("full", prompt(1, 64))   # ... an embedding input may fill the context
        assert out.finish_reason is FinishReason.STOP and len(out.embedding or b"") == 4 * 576
        for bad in ([], prompt(1, 65), [49152]):
            with pytest.raises(EngineRequestError):
                await engine.embed("bad", bad)
        loop, started = asyncio.get_running_loop(), asyncio.Event()

        def hold(batch: ForwardBatch) -> None:   # the engine thread waits in the first chunk until cancelled
            loop.call_soon_threadsafe(started.set)
            release.wait(DEFAULT_TIMEOUT_S)
        view.on_step = hold
        task = asyncio.ensure_future(engine.embed("cancelled", prompt(2, 60)))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()

        def settled() -> bool:   # the full one and the cancelled one ended, and every block is free
            if engine.stats().num_finished_sequences < 2:   # (the stats are published after the load report)
                return False
            r = engine.load_report()
            return r.num_running == 0 and r.num_waiting == 0 and r.num_free_blocks == r.num_total_blocks
        await await_until(settled, "the cancelled embedding's blocks to be free")
        assert engine.stats().num_prompt_tokens == 64   # the cancelled input never completed its prompt
    finally:
        release.set()
        await engine.shutdown()
