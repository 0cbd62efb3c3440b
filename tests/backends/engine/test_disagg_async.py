"""DisaggAsyncEngine on the real bundled model: a failure of the engine loop while a decode leg's pull
is in flight aborts the other sequences but leaves the pulling one its blocks (the pull still writes
them), and that leg then decodes exactly what a unified sequence decodes."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.engine.config import EngineConfig
from backends.engine.disagg_engine import DisaggAsyncEngine
from backends.engine.outputs import FinishReason
from backends.engine.remote_kv import RemoteAdmission, RemoteKVEngine
from backends.engine.sampling_params import SamplingParams
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView

NUM_BLOCKS = 48
BLOCK = 16


@pytest.fixture
async def engine(smollm2_dir: Path, smollm2_runner: ModelRunner) -> AsyncIterator[DisaggAsyncEngine]:
    config = EngineConfig(model_dir=str(smollm2_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK,
                          max_num_batched_tokens=128, torch_num_threads=2, enable_prefix_caching=False)
    eng = DisaggAsyncEngine(config, engine_factory=lambda c: RemoteKVEngine(c, RunnerView(smollm2_runner, NUM_BLOCKS),
                                                                            smollm2_dir))
    await eng.start()
    yield eng
    await eng.shutdown()


async def collect(stream: AsyncIterator) -> list:
    return [o async for o in stream]


def token_ids(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


async def test_engine_loop_failure_spares_a_decode_leg_whose_pull_is_in_flight(
        engine: DisaggAsyncEngine, smollm2_runner: ModelRunner) -> None:
    target = list(range(300, 340))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    unified = token_ids(await collect(engine.generate("unified", target, params)))
    first = token_ids(await collect(engine.generate_prefill("pre", target, SamplingParams(max_tokens=1, temperature=0.0))))
    assert first == unified[:1]
    hold = engine.hold("pre")
    assert hold is not None

    admitted: asyncio.Future[RemoteAdmission] = asyncio.get_running_loop().create_future()
    go = asyncio.Event()

    async def pull(admission: RemoteAdmission) -> None:       # stands in for the network pull
        admitted.set_result(admission)
        await go.wait()
        smollm2_runner.kv_cache.copy_blocks(list(hold.block_ids), list(admission.block_ids))

    decode = asyncio.create_task(collect(engine.generate_remote("dec", target, params, first, pull)))
    admission = await asyncio.wait_for(admitted, 30)
    inner = engine._engine
    assert isinstance(inner, RemoteKVEngine)
    real_step = inner.step

    def broken_step():      # a bug outside any one batch: the loop's boundary aborts what it may
        inner.step = real_step
        raise RuntimeError("injected engine loop failure")

    inner.step = broken_step
    victim = await asyncio.wait_for(collect(engine.generate("victim", list(range(500, 520)), params)), 30)
    assert victim[-1].finish_reason is FinishReason.ABORT and victim[-1].error == "engine loop failed"
    # the pulling leg still owns its blocks: another request cannot be given them
    report = engine.load_report()
    assert report.num_free_blocks <= NUM_BLOCKS - len(hold.block_ids) - len(admission.block_ids)
    assert not decode.done()

    go.set()
    outputs = await asyncio.wait_for(decode, 30)
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].error is None
    assert token_ids(outputs) == unified[1:]
    assert engine.release_transfer("pre")
    for _ in range(200):
        if engine.load_report().num_free_blocks == NUM_BLOCKS:
            break
        await asyncio.sleep(0.01)
    assert engine.load_report().num_free_blocks == NUM_BLOCKS
