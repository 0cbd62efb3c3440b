"""LLMEngine with a KV connector on the real bundled model: a prefill leg's blocks are kept (not free,
not leaked) until the connector has sent them; a decode leg waits for its load, continues after the
first token and samples what a unified sequence samples once its prompt KV is copied in from the kept
blocks (a stand-in for the network pull), wherever float32 rounding cannot decide the draw: the prefill
leg computes only its prompt's uncached tail, so its logits and KV may round differently from the
unified sequence's (tests/backends/numerics.py); a failed load fails only its sequence."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from backends.core.engine_config import EngineConfig
from backends.core.kv_transfer_params import KVTransferParams
from backends.core.outputs import FinishReason
from backends.core.sampling_params import SamplingParams
from backends.core.sequence import SequenceStatus
from backends.engine.engine import LLMEngine
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.fake_connector import PREFILL, REMOTE, FakeConnector
from tests.backends.engine.runner_view import RunnerView
from tests.backends.engine.test_engine_model import prompt, run_all, tokens
from tests.backends.numerics import assert_same_tokens, choices, logit_tolerance

BLOCK = 16


def make(runner: ModelRunner, model_dir: Path, num_blocks: int = 32, **kw: int) -> tuple[LLMEngine, FakeConnector]:
    config = EngineConfig(model_dir=str(model_dir), block_size=BLOCK, num_blocks=num_blocks, **kw)
    connector = FakeConnector()
    return LLMEngine(config, RunnerView(runner, num_blocks), model_dir, kv_connector=connector), connector


def decode_leg(first_token_ids: list[int]) -> KVTransferParams:
    return dataclasses.replace(REMOTE, first_token_ids=tuple(first_token_ids))


@pytest.mark.parametrize("prompt_len", [20, 32])
def test_kept_prefill_then_loaded_decode_equals_unified(smollm2_runner: ModelRunner, smollm2_dir: Path,
                                                         hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module,
                                                         prompt_len: int) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=99, ignore_eos=True)
    target = prompt(5, prompt_len)
    engine, connector = make(smollm2_runner, smollm2_dir)
    engine.add_request("unified", target, params)
    unified = tokens(run_all(engine)["unified"])
    assert isinstance(engine.runner, RunnerView)
    unified_logits = torch.cat([logits for _, logits in engine.runner.steps])   # a row per token drawn
    assert unified_logits.shape[0] == len(unified)
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [target + unified])
    reference = choices(unified_logits, params, params.seed, engine.eos_token_ids, tolerance, target)
    # The prefill leg draws its one token with the request's parameters, as the gateway sends them.
    engine.add_request("pre", target, SamplingParams(max_tokens=1, temperature=0.9, seed=99, ignore_eos=True), PREFILL)
    out = run_all(engine)["pre"]
    same_first = assert_same_tokens(tokens(out), unified[:1], reference[:1], "the prefill leg's token")
    assert out[-1].finish_reason is FinishReason.LENGTH
    kept = connector.kept["pre"]
    bm = engine.block_manager
    assert len(kept) == -(-prompt_len // BLOCK) and engine.load_report().num_held_blocks == len(kept)
    assert all(bm.ref_count(b) > 0 for b in kept)
    bm.check_invariants()

    engine.add_request("dec", target, params, decode_leg(tokens(out)))
    assert engine.step() == []   # admitted, waiting for its KV: nothing runs
    seq = engine.scheduler.get("dec")
    assert seq is not None and seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV
    assert list(connector.loads) == ["dec"] and connector.num_start_calls > 0
    assert seq.num_computed_tokens == (prompt_len // BLOCK) * BLOCK   # hits on the kept blocks' hashes
    start = seq.num_computed_tokens // BLOCK
    smollm2_runner.kv_cache.copy_blocks(list(kept[start:]), seq.block_table[start:len(kept)])
    assert connector.release("pre") and not connector.release("pre")
    assert connector.finish_load("dec")
    if same_first:   # otherwise the legs continue another sequence than the unified one
        assert_same_tokens(unified[:1] + tokens(run_all(engine)["dec"]), unified, reference, "prefill + decode legs")
    else:
        run_all(engine)
    bm.check_invariants()
    assert bm.num_held_blocks == 0 and bm.num_free_blocks == bm.num_total_blocks


def test_stop_finish_abort_and_failed_load_keep_nothing(smollm2_runner: ModelRunner, smollm2_dir: Path) -> None:
    engine, connector = make(smollm2_runner, smollm2_dir, num_blocks=8)
    target = prompt(6, 10)
    engine.add_request("probe", target, SamplingParams(max_tokens=1, temperature=0.0))
    first = tokens(run_all(engine)["probe"])[0]
    engine.add_request("stop", target, SamplingParams(max_tokens=1, temperature=0.0, stop_token_ids=(first,)), PREFILL)
    assert run_all(engine)["stop"][-1].finish_reason is FinishReason.STOP
    engine.add_request("gone", target, SamplingParams(max_tokens=1), PREFILL)
    engine.abort_request("gone")
    engine.add_request("waiting", target, SamplingParams(max_tokens=4), decode_leg([first]))
    engine.step()
    assert list(connector.loads) == ["waiting"]
    engine.abort_request("waiting")   # the client left: its blocks go once the load has stopped
    assert engine.block_manager.num_free_blocks < 8
    connector.finish_load("waiting")
    engine.add_request("failing", target, SamplingParams(max_tokens=4), decode_leg([first]))
    engine.step()
    connector.finish_load("failing", "peer closed")
    (final,) = engine.step()
    assert final.request_id == "failing" and final.finish_reason is FinishReason.ABORT and final.error == "peer closed"
    assert not connector.kept and engine.block_manager.num_held_blocks == 0
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == 8 and not engine.has_unfinished()


def test_a_step_that_samples_nothing_is_not_a_failure(smollm2_runner: ModelRunner, smollm2_dir: Path) -> None:
    """A lone long prompt on a prefill worker: its first chunks want no logits (regression: the sampler
    failed on zero rows and the engine aborted the sequence)."""
    engine, connector = make(smollm2_runner, smollm2_dir, num_blocks=16, max_num_batched_tokens=16)
    engine.add_request("long", prompt(7, 40), SamplingParams(max_tokens=1, temperature=0.0), PREFILL)
    out = run_all(engine)["long"]
    assert out[-1].error is None and out[-1].finish_reason is FinishReason.LENGTH and len(tokens(out)) == 1
    assert list(connector.kept) == ["long"]
