"""A group of ranks that loses one goes down whole, within its timeout, and leaves no process behind:

- rank 1 killed in the middle of a stream (a tensor-parallel peer, or the second pipeline stage): the stream
  ends (no hang), /health answers 503 with the reason, new requests get 503 `engine_dead`, and rank 0 exits
  cleanly on SIGTERM;
- rank 1 stopped (SIGSTOP: alive, silent): rank 0's watchdog fails the group after the timeout and kills it;
- rank 0 killed: rank 1 exits by itself (the kernel's parent-death signal).
"""
from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.backends.executor.ranks import gone, rank_pids
from tests.backends.executor.tp_checkpoints import tiny_llama
from tests.backends.pd_http import post, stream
from tests.support.wait import await_until, wait_until
from tests.support.worker_proc import WorkerProcess

pytestmark = pytest.mark.slow

NAME = "tiny-llama"
TIMEOUT_S = 4.0   # the group's --distributed-timeout-s
LONG = {"model": NAME, "prompt": "Count with me:", "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-faults")
    tiny_llama(folder)
    return folder


@pytest.fixture
def group(folder: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[WorkerProcess]:
    """Two ranks: tensor-parallel (the default) or, with the parameter "pp2", two pipeline stages."""
    split = "--pipeline-parallel-size" if getattr(request, "param", "tp2") == "pp2" else "--tensor-parallel-size"
    worker = WorkerProcess(["--model", str(folder), split, "2", "--threads", "1",
                            "--num-blocks", "64", "--served-model-name", NAME,
                            "--distributed-timeout-s", str(TIMEOUT_S)], log_dir=tmp_path)
    try:
        yield worker
    finally:
        worker.stop()


async def health(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as response:
        return response.status, await response.json()


async def assert_failed(worker: WorkerProcess, reason: str) -> None:
    """/health answers 503 with `reason` in its error, and a new request is refused with 503 `engine_dead`."""
    async def failed() -> bool:
        return (await health(worker.url))[0] == 503
    await await_until(failed, "/health to answer 503", timeout_s=3 * TIMEOUT_S + 10)
    _, body = await health(worker.url)
    assert body["status"] == "failed" and reason in str(body["error"]), body
    status, refused = await post(worker.url, {**LONG, "max_tokens": 2})
    assert status == 503 and refused["error"]["code"] == "engine_dead", refused


@pytest.mark.parametrize("group", ["tp2", "pp2"], indirect=True)
async def test_a_rank_killed_mid_stream_ends_the_group(group: WorkerProcess) -> None:
    rank, = rank_pids(group.pid)
    events: list[dict[str, object]] = []
    streaming = asyncio.ensure_future(stream(group.url, LONG, events=events))
    await await_until(lambda: len(events) >= 2 or streaming.done(), "the stream's first tokens")
    os.kill(rank, signal.SIGKILL)
    try:
        await asyncio.wait_for(streaming, 3 * TIMEOUT_S + 10)   # the stream ends rather than hanging
    except AssertionError:
        pass   # it may end with an error status
    except aiohttp.ClientPayloadError:
        pass   # or cut
    assert sum(1 for e in events if e.get("choices")) < LONG["max_tokens"]
    await assert_failed(group, "rank 1")
    wait_until(lambda: gone(rank), "rank 1 to be reaped")
    assert group.alive and rank_pids(group.pid) == []
    group.send_signal(signal.SIGTERM)
    assert group.wait_exit(60) == 0, group.log()


async def test_a_stopped_rank_is_failed_by_the_watchdog_and_killed(group: WorkerProcess) -> None:
    rank, = rank_pids(group.pid)
    status, _ = await post(group.url, {**LONG, "max_tokens": 2})
    assert status == 200
    os.kill(rank, signal.SIGSTOP)   # alive, answering nothing: a hung rank
    await assert_failed(group, "rank 1 has not answered")
    wait_until(lambda: gone(rank), "the stopped rank to be killed")
    assert rank_pids(group.pid) == []


def test_rank_0_killed_takes_the_other_ranks_with_it(group: WorkerProcess) -> None:
    rank, = rank_pids(group.pid)
    group.send_signal(signal.SIGKILL)
    group.wait_exit(30)
    wait_until(lambda: gone(rank), "rank 1 to exit after rank 0", timeout_s=3 * TIMEOUT_S + 10)
