"""RemoteKVEngine on the real bundled model: a prefill sequence's blocks are held (not free, not leaked)
until released; a remote-KV sequence continues after the first token and samples exactly what a unified
sequence samples once its prompt KV is copied in from the held blocks (a stand-in for the network pull)."""
from __future__ import annotations

from pathlib import Path

import pytest

from backends.engine.config import EngineConfig
from backends.engine.outputs import FinishReason
from backends.engine.remote_kv import RemoteKVEngine
from backends.engine.sampling_params import SamplingParams
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView
from tests.backends.engine.test_engine_model import prompt, run_all, tokens

BLOCK = 16


def make(runner: ModelRunner, model_dir: Path, num_blocks: int = 32) -> RemoteKVEngine:
    config = EngineConfig(model_dir=str(model_dir), block_size=BLOCK, num_blocks=num_blocks)
    return RemoteKVEngine(config, RunnerView(runner, num_blocks), model_dir)


@pytest.mark.parametrize("prompt_len", [20, 32])
def test_held_prefill_then_remote_decode_equals_unified(smollm2_runner: ModelRunner, smollm2_dir: Path,
                                                        prompt_len: int) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=99, ignore_eos=True)
    target = prompt(5, prompt_len)
    engine = make(smollm2_runner, smollm2_dir)
    engine.add_request("unified", target, params)
    unified = tokens(run_all(engine)["unified"])
    engine.add_prefill_request("pre", target, SamplingParams(max_tokens=1, temperature=0.9, seed=99))
    out = run_all(engine)["pre"]
    assert tokens(out) == unified[:1] and out[-1].finish_reason is FinishReason.LENGTH
    (hold,) = engine.take_new_holds()
    bm = engine.block_manager
    assert hold.block_ids == bm.held_blocks(hold.handle) and len(hold.block_ids) == -(-prompt_len // BLOCK)
    assert bm.num_held_blocks == len(hold.block_ids) and all(bm.ref_count(b) > 0 for b in hold.block_ids)
    bm.check_invariants()

    engine.add_remote_request("dec", target, params, unified[:1])
    assert engine.step() == []   # admitted, waiting for its KV: nothing runs
    (admission,) = engine.take_admissions()
    assert engine.take_admissions() == []   # reported once
    assert admission.num_cached_tokens == (prompt_len // BLOCK) * BLOCK   # hits on the held blocks' hashes
    start = admission.num_cached_tokens // BLOCK
    dst = list(admission.block_ids[start:])
    smollm2_runner.kv_cache.copy_blocks(list(hold.block_ids[start:]), dst)
    assert engine.release_hold(hold.handle) and not engine.release_hold(hold.handle)
    assert engine.remote_kv_ready("dec")
    assert tokens(run_all(engine)["dec"]) == unified[1:]
    bm.check_invariants()
    assert bm.num_held_blocks == 0 and bm.num_free_blocks == bm.num_total_blocks


def test_stop_finish_and_abort_hold_nothing(smollm2_runner: ModelRunner, smollm2_dir: Path) -> None:
    engine = make(smollm2_runner, smollm2_dir, num_blocks=8)
    target = prompt(6, 10)
    first = tokens(run_all(_with(engine, "probe", target))["probe"])[0]
    engine.add_prefill_request("stop", target, SamplingParams(max_tokens=1, temperature=0.0, stop_token_ids=(first,)))
    assert run_all(engine)["stop"][-1].finish_reason is FinishReason.STOP
    engine.add_prefill_request("gone", target, SamplingParams(max_tokens=1))
    engine.abort_request("gone")
    engine.add_remote_request("waiting", target, SamplingParams(max_tokens=4), [first])
    engine.step()
    assert engine.take_admissions()[0].request_id == "waiting"
    engine.abort_request("waiting")   # e.g. the pull failed: its blocks go back
    assert engine.take_new_holds() == [] and engine.block_manager.num_held_blocks == 0
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == 8


def _with(engine: RemoteKVEngine, request_id: str, ids: list[int]) -> RemoteKVEngine:
    engine.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0))
    return engine


def test_a_step_that_samples_nothing_is_not_a_failure(smollm2_runner: ModelRunner, smollm2_dir: Path) -> None:
    """A lone long prompt on a prefill worker: its first chunks want no logits (regression: the sampler
    failed on zero rows and the engine aborted the sequence)."""
    config = EngineConfig(model_dir=str(smollm2_dir), block_size=BLOCK, num_blocks=16, max_num_batched_tokens=16)
    engine = RemoteKVEngine(config, RunnerView(smollm2_runner, 16), smollm2_dir)
    engine.add_prefill_request("long", prompt(7, 40), SamplingParams(max_tokens=1, temperature=0.0))
    out = run_all(engine)["long"]
    assert out[-1].error is None and out[-1].finish_reason is FinishReason.LENGTH and len(tokens(out)) == 1
    assert len(engine.take_new_holds()) == 1
