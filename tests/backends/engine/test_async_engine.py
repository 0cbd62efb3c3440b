"""AsyncEngine on the real bundled model: streaming, immediate refusal of bad requests,
cancellation and abort freeing blocks, a failing step failing only its sequences, and an event
loop that serves while the step thread works (which sleeps when idle)."""
from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from backends.core.engine_config import EngineConfig
from backends.core.outputs import FinishReason
from backends.core.sampling_params import SamplingParams
from backends.engine.async_engine import AsyncEngine, EngineRequestError
from backends.engine.engine import LLMEngine
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView
from tests.backends.numerics import assert_mostly_clear, assert_same_tokens, choices, logit_tolerance
from tests.support.wait import DEFAULT_TIMEOUT_S, await_until

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


async def settled(engine: AsyncEngine) -> None:
    """Wait until the engine has nothing live and every block is free (or only cached)."""
    def idle() -> bool:
        r = engine.load_report()
        return r.num_running == 0 and r.num_waiting == 0 and r.num_free_blocks == r.num_total_blocks
    await await_until(idle, "the engine to settle")


async def test_generate_streams_tokens_like_transformers(engine: AsyncEngine, hf_smollm2: torch.nn.Module,
                                                         hf_smollm2_f64: torch.nn.Module) -> None:
    prompt = [1, 4093, 314, 253, 5356, 28, 314, 6479, 30]
    outs = await collect(engine.generate("g", prompt, GREEDY))
    with torch.inference_mode():
        ref = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, eos_token_id=list(engine.eos_token_ids),
                                  pad_token_id=0)
    ref_ids = ref.sequences[0, len(prompt):].tolist()
    got = [t for o in outs for t in o.new_token_ids]
    # transformers' kernels round differently from ours: tokens compared where rounding cannot decide
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [prompt + ref_ids])
    reference = choices(torch.cat(ref.logits).float(), GREEDY, None, engine.eos_token_ids, tolerance)
    assert_mostly_clear([reference], "transformers' greedy tokens")
    assert_same_tokens(got, ref_ids, reference, "greedy against transformers")
    assert outs[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
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


def step_thread() -> threading.Thread:
    (thread,) = [t for t in threading.enumerate() if t.name == "switchyard-engine"]
    return thread


def asleep_for_news(thread: threading.Thread) -> bool:
    """The thread is blocked in an untimed Condition.wait: it cannot run again until notified."""
    frame = sys._current_frames().get(thread.ident or -1)
    return (frame is not None and frame.f_code is threading.Condition.wait.__code__
            and frame.f_locals.get("timeout") is None)


async def test_event_loop_serves_while_a_step_runs_and_the_idle_loop_sleeps(engine: AsyncEngine,
                                                                              view: RunnerView) -> None:
    loop = asyncio.get_running_loop()
    loop_thread = threading.current_thread()
    served: list[bool] = []

    def ask_the_loop(batch: object) -> None:
        """In the step thread, as a step starts: hand the event loop a callback and wait until it has
        run it. Steps on the loop's thread, or a loop blocked on the step, could never answer."""
        assert threading.current_thread() is not loop_thread
        answered = threading.Event()
        loop.call_soon_threadsafe(answered.set)
        served.append(answered.wait(DEFAULT_TIMEOUT_S))   # the deadline only ends a broken run

    view.on_step = ask_the_loop
    await collect(engine.generate("busy", list(range(600, 900)), SamplingParams(max_tokens=8, ignore_eos=True)))
    view.on_step = lambda batch: None
    assert len(served) >= 8 and all(served), served
    await settled(engine)
    # Idle, the step thread waits on its condition without a timeout (no polling, no busy loop) ...
    thread = step_thread()
    await await_until(lambda: asleep_for_news(thread), "the idle step thread to wait for news")
    # ... and a request wakes it.
    outs = await collect(engine.generate("wake", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)))
    assert outs[-1].finish_reason is FinishReason.LENGTH
    await settled(engine)


async def test_kv_events_and_load_report_follow_the_engine(engine: AsyncEngine) -> None:
    prompt = list(range(700, 740))
    await collect(engine.generate("ev", prompt, SamplingParams(max_tokens=1)))
    batch = engine.kv_events(0)
    assert not batch.reset and len(batch.events) >= 2 and batch.next_since == batch.events[-1].seq_no
    assert engine.kv_events(batch.next_since).events == ()
    assert engine.load_report().num_cached_blocks >= 2


async def test_the_step_thread_builds_the_engine_and_a_failed_build_reaches_start(smollm2_dir: Path,
                                                                                   view: RunnerView) -> None:
    """The model is built in the thread that steps it (a CPU model built in another thread stepped ~1.8x
    slower: docs/benchmarks.md, issue 18), and an error while building is start()'s to raise."""
    builders: list[threading.Thread] = []

    def build(config: EngineConfig) -> LLMEngine:
        builders.append(threading.current_thread())
        return LLMEngine(config, view, smollm2_dir)

    config = EngineConfig(model_dir=str(smollm2_dir), num_blocks=NUM_BLOCKS, torch_num_threads=2)
    eng = AsyncEngine(config, build)
    await eng.start()
    try:
        assert builders == [eng._thread] and builders[0] is not threading.main_thread()
        assert (await collect(eng.generate("r", [1, 2, 3], GREEDY)))[-1].finish_reason is FinishReason.LENGTH
    finally:
        await eng.shutdown()

    def broken(config: EngineConfig) -> LLMEngine:
        builders.append(threading.current_thread())
        raise OSError("no such model")

    failing = AsyncEngine(config, broken)
    with pytest.raises(OSError, match="no such model"):
        await failing.start()
    builders[-1].join(timeout=DEFAULT_TIMEOUT_S)
    assert not builders[-1].is_alive()                  # the step thread ended with the failed build
    with pytest.raises(RuntimeError):
        failing.generate("r", [1, 2, 3], GREEDY)        # nothing to step
