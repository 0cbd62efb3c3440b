"""SIGTERM to a real worker under load: it drains. Streams in flight decode to their end, new
generation requests and /health get an OpenAI-style 503 while the listener stays open, and the
process exits 0 once the last stream ended."""
from __future__ import annotations

import asyncio
import signal

import aiohttp
import orjson

from tests.support.wait import await_until
from tests.support.worker_proc import WorkerProcess

NUM_TOKENS = 200  # long enough to be mid-stream when the checks below run, on any machine


async def test_sigterm_drains_then_exits_zero(tmp_path) -> None:
    # The drain deadline only bounds a broken run: 200 tokens took over the default 30 s on a loaded 2-core machine.
    worker = WorkerProcess(["--max-num-seqs", "8", "--drain-timeout-s", "600"], log_dir=tmp_path)
    try:
        # No whole-request deadline (aiohttp's default is 300 s): on a loaded machine the streams take longer, and
        # pytest's own timeout bounds a broken run; a stall between chunks still ends it.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=300)) as client:
            url = worker.url
            body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": NUM_TOKENS,
                    "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}

            async def stream() -> tuple[int, int | None, bool]:
                """Status, completion tokens in the final usage chunk, and whether [DONE] arrived."""
                num_tokens, done = None, False
                async with client.post(url + "/v1/completions", json=body) as response:
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            usage = orjson.loads(line[6:]).get("usage")
                            num_tokens = usage["completion_tokens"] if usage else num_tokens
                        done = done or line.startswith(b"data: [DONE]")
                    return response.status, num_tokens, done

            tasks = [asyncio.create_task(stream()) for _ in range(3)]

            async def all_running() -> bool:
                async with client.get(url + "/load") as response:
                    return (await response.json())["num_running"] == len(tasks)
            await await_until(all_running, "three sequences running")

            worker.send_signal(signal.SIGTERM)

            async def refused(method: str, path: str, **kwargs) -> dict:
                async with client.request(method, url + path, **kwargs) as response:
                    assert response.status == 503, await response.text()
                    return (await response.json())["error"]

            async def health_says_draining() -> bool:
                async with client.get(url + "/health") as response:
                    return response.status == 503
            await await_until(health_says_draining, "/health to turn 503")
            error = await refused("POST", "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert error["code"] == "shutting_down" and error["type"] == "service_unavailable_error"
            # A gateway's release of a KV hold still lands: the drain waits for held blocks to go.
            async with client.post(url + "/kv_holds/release", json={"transfer_id": "none-held"}) as response:
                assert (response.status, await response.json()) == (200, {"released": False})
            assert not any(t.done() for t in tasks), "a stream ended before the checks: make NUM_TOKENS larger"

            results = await asyncio.gather(*tasks)
        assert results == [(200, NUM_TOKENS, True)] * len(tasks)  # every stream decoded to its end
        assert worker.wait_exit() == 0
        assert "drain" in worker.log()
    finally:
        worker.stop()
