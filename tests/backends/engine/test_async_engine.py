"""AsyncEngine on the real bundled model: streaming, immediate refusal of bad requests,
cancellation and abort freeing blocks, a failing step failing only its sequences, and an event
loop that stays responsive while the step thread works (and sleeps when idle)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from backends.engine.async_engine import AsyncEngine, EngineRequestError
from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.outputs import FinishReason
from backends.engine.sampling_params import SamplingParams
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView

NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture
def view(smollm2_runner: ModelRunner) -> RunnerView:
    return RunnerView(smollm2_runner, NUM_BLOCKS)


@pytest.fixture
async def engine(smollm2_dir: Path, view: RunnerView) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(model_dir=str(smollm2_dir), num_blocks=NUM_BLOCKS, max_num_batched_tokens=128,
                          torch_num_threads=2)
    eng = AsyncEngine(config, lambda c: LLMEngine(c, view, smollm2_dir))
    await eng.start()
    yield eng
    await eng.shutdown()


async def collect(stream: AsyncIterator) -> list:
    return [o async for o in stream]


async def settled(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    """Wait until the engine has nothing live and every block is free (or only cached)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = engine.load_report()
        if r.num_running == 0 and r.num_waiting == 0 and r.num_free_blocks == r.num_total_blocks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not settle: {engine.load_report()}")


async def test_generate_streams_tokens_like_transformers(engine: AsyncEngine,
                                                         hf_smollm2: torch.nn.Module) -> None:
    prompt = [1, 4093, 314, 253, 5356, 28, 314, 6479, 30]
    outs = await collect(engine.generate("g", prompt, GREEDY))
    with torch.inference_mode():
        ref = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                  eos_token_id=list(engine.eos_token_ids), pad_token_id=0)[0, len(prompt):]
    got = [t for o in outs for t in o.new_token_ids]
    assert got == ref.tolist()[:len(got)] and outs[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert all(o.finish_reason is None for o in outs[:-1]) and outs[-1].num_prompt_tokens == len(prompt)
    await settled(engine)
    report = engine.load_report()
    assert (report.num_total_blocks, report.block_size) == (NUM_BLOCKS, 16)
    assert engine.stats().num_generation_tokens == len(got)
    assert engine.vocab_size == 49152 and 2 in engine.eos_token_ids


async def test_bad_requests_are_refused_at_once(engine: AsyncEngine) -> None:
    with pytest.raises(EngineRequestError, match="context"):
        engine.generate("long", [5] * engine.max_model_len, GREEDY)
    with pytest.raises(EngineRequestError):
        engine.generate("empty", [], GREEDY)
    with pytest.raises(EngineRequestError):
        engine.generate("vocab", [engine.vocab_size], GREEDY)
    with pytest.raises(EngineRequestError):
        engine.generate("topp", [5], SamplingParams(top_p=0.0))
    stream = engine.generate("dup", [5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    with pytest.raises(EngineRequestError, match="already"):
        engine.generate("dup", [5, 6], GREEDY)
    await stream.aclose()
    await settled(engine)


async def test_closing_or_cancelling_the_stream_frees_blocks(engine: AsyncEngine) -> None:
    stream = engine.generate("closed", list(range(100, 140)), SamplingParams(max_tokens=500, ignore_eos=True))
    first = await stream.__anext__()
    assert first.new_token_ids and first.num_prompt_tokens == 40
    await stream.aclose()
    await settled(engine)

    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("cancelled", list(range(200, 240)),
                                       SamplingParams(max_tokens=500, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=30)
    assert engine.load_report().num_running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settled(engine)


async def test_abort_frees_blocks_before_returning_and_is_idempotent(engine: AsyncEngine) -> None:
    stream = engine.generate("ab", list(range(300, 350)), SamplingParams(max_tokens=500, ignore_eos=True))
    await stream.__anext__()
    assert engine.load_report().num_free_blocks < NUM_BLOCKS
    await engine.abort("ab")
    report = engine.load_report()
    assert report.num_running == 0 and report.num_free_blocks == NUM_BLOCKS
    rest = await collect(stream)
    assert rest[-1].finish_reason is FinishReason.ABORT and rest[-1].error is None
    await engine.abort("ab")
    await engine.abort("never-existed")


async def test_failed_step_fails_only_its_sequences(engine: AsyncEngine, view: RunnerView) -> None:
    doomed = list(range(400, 430))
    view.fail_if = lambda batch: any(c.token_ids[:3] == tuple(doomed[:3]) for c in batch.chunks)
    outs = await collect(engine.generate("doomed", doomed, GREEDY))
    assert outs[-1].finish_reason is FinishReason.ABORT and "injected" in (outs[-1].error or "")
    view.fail_if = lambda batch: False
    ok = await collect(engine.generate("fine", list(range(500, 520)), GREEDY))
    assert ok[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and ok[-1].error is None
    await settled(engine)
    assert engine.stats().num_failed_sequences == 1


async def test_event_loop_stays_responsive_and_idle_loop_sleeps(engine: AsyncEngine) -> None:
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    started = time.perf_counter()
    await collect(engine.generate("busy", list(range(600, 900)),
                                  SamplingParams(max_tokens=8, ignore_eos=True)))
    busy_s = time.perf_counter() - started
    stop.set()
    await tick
    assert max(gaps) < max(0.25, busy_s / 4), (max(gaps), busy_s)
    await settled(engine)
    await asyncio.sleep(0.3)                    # let OpenMP workers stop spinning after the last step
    cpu = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - cpu < 0.1      # no busy-wait in the step thread


async def test_kv_events_and_load_report_follow_the_engine(engine: AsyncEngine) -> None:
    prompt = list(range(700, 740))
    await collect(engine.generate("ev", prompt, SamplingParams(max_tokens=1)))
    batch = engine.kv_events(0)
    assert not batch.reset and len(batch.events) >= 2 and batch.next_since == batch.events[-1].seq_no
    assert engine.kv_events(batch.next_since).events == ()
    assert engine.load_report().num_cached_blocks >= 2
