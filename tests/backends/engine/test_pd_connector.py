"""AsyncEngine with the P/D connector on the real bundled model, the network replaced by a transport
that copies blocks within the one cache. A failure of the engine loop while a decode leg's pull is in
flight aborts the other sequences but leaves the pulling one its blocks (the pull still writes them),
and that leg then decodes exactly what a unified sequence decodes; a failed pull fails its leg with
the transfer error and frees its blocks; a client that leaves mid-pull cancels it; holds expire."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from backends.core.engine_config import EngineConfig
from backends.core.kv_transfer_params import KVTransferParams
from backends.core.outputs import FinishReason
from backends.core.sampling_params import SamplingParams
from backends.engine.async_engine import AsyncEngine
from backends.engine.engine import LLMEngine
from backends.kv_connectors.pd_connector import PDConnector
from backends.kv_transfer.base import (
    KVBlockSink,
    KVBlockSource,
    KVErrorCode,
    KVTransferError,
    KVTransport,
    PullResult,
    RemoteBlocks,
)
from backends.kv_transfer.torch_cache import TorchPagedKV
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView
from tests.support.wait import await_until

NUM_BLOCKS = 48
BLOCK = 16
PREFILL = KVTransferParams(do_remote_decode=True)


class CopyTransport(KVTransport):
    """Pulls by copying the held blocks within the same cache, once `go` is set (or fails with `error`)."""

    def __init__(self, runner: ModelRunner, connector: PDConnector) -> None:
        self.runner, self.connector = runner, connector
        self.pulling: asyncio.Queue[tuple[int, ...]] = asyncio.Queue()   # destination blocks of each pull
        self.go = asyncio.Event()
        self.error: KVTransferError | None = None
        self.num_releases = 0

    async def serve(self, source: KVBlockSource, host: str, port: int) -> tuple[str, int]:
        raise NotImplementedError

    async def pull(self, remote: RemoteBlocks, sink: KVBlockSink, block_ids: Sequence[int],
                   start_block: int = 0) -> PullResult:
        self.pulling.put_nowait(tuple(block_ids))
        await self.go.wait()
        held = self.connector.lookup(remote.transfer_id)
        if self.error is not None or held is None:
            raise self.error or KVTransferError(KVErrorCode.UNKNOWN_TRANSFER, remote.transfer_id)
        self.runner.kv_cache.copy_blocks(list(held[start_block:]), list(block_ids))
        self.connector.release_transfer(remote.transfer_id)
        return PullResult(remote.transfer_id, len(block_ids), 0, 0.0, True)

    async def release(self, remote: RemoteBlocks) -> bool:
        self.num_releases += 1
        return self.connector.release_transfer(remote.transfer_id)

    async def close(self) -> None:
        pass


@pytest.fixture
async def pd(smollm2_dir: Path, smollm2_runner: ModelRunner) -> AsyncIterator[tuple[AsyncEngine, PDConnector,
                                                                                     CopyTransport]]:
    config = EngineConfig(model_dir=str(smollm2_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK,
                          max_num_batched_tokens=128, torch_num_threads=2, enable_prefix_caching=False)
    connector = PDConnector(hold_timeout_s=30.0)
    engine = AsyncEngine(config, lambda c: LLMEngine(c, RunnerView(smollm2_runner, NUM_BLOCKS), smollm2_dir,
                                                     kv_connector=connector))
    await engine.start()
    transport = CopyTransport(smollm2_runner, connector)
    cache = smollm2_runner.kv_cache
    connector.attach(transport, TorchPagedKV(list(zip(cache.k, cache.v, strict=True))), engine.wake)
    yield engine, connector, transport
    await connector.detach()
    await engine.shutdown()


async def collect(stream: AsyncIterator) -> list:
    return [o async for o in stream]


def token_ids(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def decode_leg(transfer_id: str, first: list[int]) -> KVTransferParams:
    return KVTransferParams(remote=RemoteBlocks("127.0.0.1", 1, transfer_id, None), first_token_ids=tuple(first))


async def all_free(engine: AsyncEngine) -> None:
    await await_until(lambda: engine.load_report().num_free_blocks == NUM_BLOCKS
                      and engine.load_report().num_held_blocks == 0, "every block free", timeout_s=10)


async def test_engine_loop_failure_spares_a_decode_leg_whose_pull_is_in_flight(
        pd: tuple[AsyncEngine, PDConnector, CopyTransport]) -> None:
    engine, connector, transport = pd
    target = list(range(300, 340))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    unified = token_ids(await collect(engine.generate("unified", target, params)))
    first = token_ids(await collect(engine.generate("pre", target, SamplingParams(max_tokens=1, temperature=0.0),
                                                    PREFILL)))
    # exact: prefix caching is off and each sequence runs alone, so the prefill leg repeats the unified
    # prefill's shapes through the same kernels in this process (and the pull below copies bytes)
    assert first == unified[:1]
    hold = connector.hold("pre")
    assert hold is not None and engine.load_report().num_held_blocks == len(hold.block_ids)

    decode = asyncio.create_task(collect(engine.generate("dec", target, params, decode_leg("pre", first))))
    block_ids = await asyncio.wait_for(transport.pulling.get(), 30)
    inner = engine._engine
    assert inner is not None
    real_step = inner.step

    def broken_step():      # a bug outside any one batch: the loop's boundary aborts what it may
        inner.step = real_step
        raise RuntimeError("injected engine loop failure")

    inner.step = broken_step
    victim = await asyncio.wait_for(collect(engine.generate("victim", list(range(500, 520)), params)), 30)
    assert victim[-1].finish_reason is FinishReason.ABORT and victim[-1].error == "engine loop failed"
    # the pulling leg still owns its blocks: another request cannot be given them
    report = engine.load_report()
    assert report.num_free_blocks <= NUM_BLOCKS - len(hold.block_ids) - len(block_ids)
    assert not decode.done()

    transport.go.set()
    outputs = await asyncio.wait_for(decode, 30)
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].error is None
    assert token_ids(outputs) == unified[1:]   # exact: alone again, the unified decode steps' shapes on the same bytes
    assert connector.hold("pre") is None   # the pull released it
    await all_free(engine)


@pytest.mark.parametrize("code", [KVErrorCode.PEER_CLOSED, KVErrorCode.LAYOUT_MISMATCH])
async def test_a_failed_pull_fails_the_leg_and_releases_only_a_refused_hold(
        pd: tuple[AsyncEngine, PDConnector, CopyTransport], code: KVErrorCode) -> None:
    """A pull that broke leaves the remote hold for a retry; one the peer refused (other weights or layout,
    which no retry gets past) releases it."""
    engine, connector, transport = pd
    target = list(range(600, 630))
    first = token_ids(await collect(engine.generate("pre", target, SamplingParams(max_tokens=1), PREFILL)))
    transport.error = KVTransferError(code, "the pull went wrong")
    transport.go.set()
    outputs = await asyncio.wait_for(collect(engine.generate("dec", target, SamplingParams(max_tokens=4),
                                                             decode_leg("pre", first))), 30)
    assert outputs[-1].finish_reason is FinishReason.ABORT and "the pull went wrong" in (outputs[-1].error or "")
    error = connector.take_load_error("dec")
    assert error is transport.error and connector.take_load_error("dec") is None
    if code is KVErrorCode.LAYOUT_MISMATCH:
        assert transport.num_releases == 1 and connector.hold("pre") is None
    else:
        assert transport.num_releases == 0 and connector.hold("pre") is not None   # kept for a retry
        assert connector.release_transfer("pre") and not connector.release_transfer("pre")
    await all_free(engine)


async def test_a_client_that_leaves_mid_pull_cancels_it(pd: tuple[AsyncEngine, PDConnector, CopyTransport]) -> None:
    engine, connector, transport = pd
    target = list(range(700, 730))
    first = token_ids(await collect(engine.generate("pre", target, SamplingParams(max_tokens=1), PREFILL)))
    decode = asyncio.create_task(collect(engine.generate("dec", target, SamplingParams(max_tokens=4),
                                                         decode_leg("pre", first))))
    await asyncio.wait_for(transport.pulling.get(), 30)
    decode.cancel()
    await asyncio.gather(decode, return_exceptions=True)
    await await_until(lambda: engine.load_report().num_free_blocks == NUM_BLOCKS - len(connector.lookup("pre") or ()),
                      "the cancelled leg's blocks free", timeout_s=10)
    assert connector.hold("pre") is not None and engine.load_report().num_waiting == 0


async def test_a_hold_nobody_claims_expires(pd: tuple[AsyncEngine, PDConnector, CopyTransport]) -> None:
    engine, connector, _ = pd
    connector.hold_timeout_s = 0.2
    await collect(engine.generate("pre", list(range(800, 830)), SamplingParams(max_tokens=1), PREFILL))
    assert connector.hold("pre") is not None
    await all_free(engine)
    assert connector.hold("pre") is None
