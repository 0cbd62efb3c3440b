"""`switchyard gateway --workers 2`: two real gateway processes on one port (SO_REUSEPORT) under a supervising
parent, sharing a real Redis. Both serve (two pids answer, both send requests upstream), a session pinned by
one process is followed by the other, in-flight leases are shared, and SIGTERM drains both. Which process
takes a connection is the kernel's choice, so the tests open fresh connections until both have been seen."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import gateway_config
from tests.support.wait import await_until

CHAT = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def _fresh() -> aiohttp.ClientSession:
    """One new TCP connection per request, so the kernel picks a process each time."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def _scrape(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """One process's /metrics: {sample name with labels: value}."""
    async with client.get(url + "/metrics") as response:
        text = await response.text()
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _process_prefixes(request_ids: list[str]) -> set[str]:
    """Each gateway process's request ids start with its own random prefix."""
    return {request_id.rsplit("-", 1)[0] for request_id in request_ids}


def _config(providers: dict[str, list[str]], redis_url: str, **extra: object) -> dict:
    return gateway_config(providers, redis_url=redis_url, **extra)


def test_workers_above_one_need_redis(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("models: {}\nproviders: {}\n")
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "gateway", "--config", str(config),
                             "--workers", "2"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "needs `redis_url`" in result.stderr


async def test_two_processes_serve_one_port(start_fakes, start_gateway, redis_server) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(_config({"p": [fake.url]}, redis_server.url), args=("--workers", "2"))
    pids: set[int] = set()
    async with _fresh() as client:
        async def both_answered() -> bool:
            async with client.post(gateway.url + "/v1/chat/completions", json=CHAT) as response:
                assert response.status == 200, await response.text()
            pids.add(int((await _scrape(client, gateway.url))["switchyard_process_id[]"]))
            return len(pids) == 2 and len(_process_prefixes(fake.stats()["request_ids"])) == 2
        await await_until(both_answered, "two gateway processes to answer and send upstream")
    assert gateway.pid not in pids and all(_parent_pid(pid) == gateway.pid for pid in pids)


async def test_sessions_are_shared_between_processes(start_fakes, start_gateway, redis_server) -> None:
    fakes = start_fakes("a", "b")
    gateway = start_gateway(_config({"p": [f.url for f in fakes]}, redis_server.url, policy="session_affinity"),
                            args=("--workers", "2"))
    async with _fresh() as client:
        async def both_served_the_session() -> bool:
            async with client.post(gateway.url + "/v1/chat/completions", json=CHAT,
                                   headers={"x-session-affinity": "agent-7"}) as response:
                assert response.status == 200, await response.text()
            ids = [i for fake in fakes for i in fake.stats()["request_ids"]]
            return len(_process_prefixes(ids)) == 2
        await await_until(both_served_the_session, "both processes to serve the session")
    counts = sorted(fake.stats()["num_requests"] for fake in fakes)
    assert counts[0] == 0 and counts[1] >= 2  # every turn, from either process, went to the pinned endpoint


async def test_leases_are_shared_between_processes(start_fakes, start_gateway, redis_server) -> None:
    """Requests held upstream by both processes: each process's estimate counts all of them."""
    (fake,) = start_fakes("a")
    gateway = start_gateway(_config({"p": [fake.url]}, redis_server.url), args=("--workers", "2"))
    held = {"chunks": 2, "first_chunk_gate": "hold"}
    tasks: list[asyncio.Task[int]] = []
    async with _fresh() as client:
        async def call() -> int:
            async with client.post(gateway.url + "/v1/chat/completions",
                                   json={**CHAT, "stream": True, "fake": held}) as response:
                await response.read()
                return response.status

        async def held_by_both() -> bool:
            tasks.append(asyncio.create_task(call()))
            await await_until(lambda: fake.num_waiting("hold") == len(tasks), "the request held upstream")
            return len(_process_prefixes(fake.stats()["request_ids"])) == 2
        await await_until(held_by_both, "requests held from both processes")

        seen: dict[int, float] = {}
        key = f"switchyard_inflight_requests[('endpoint', '{fake.url}')]"

        async def every_process_counts_all() -> bool:
            sample = await _scrape(client, gateway.url)
            seen[int(sample["switchyard_process_id[]"])] = sample[key]
            return len(seen) == 2 and all(v == len(tasks) for v in seen.values())
        await await_until(every_process_counts_all, f"both processes to count all {len(tasks)} requests")
        fake.release("hold", len(tasks))
        assert set(await asyncio.gather(*tasks)) == {200}


async def test_sigterm_drains_both_processes(start_fakes, start_gateway, redis_server) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(_config({"p": [fake.url]}, redis_server.url), args=("--workers", "2"))
    held = {"chunks": 4, "first_chunk_gate": "drain"}
    tasks: list[asyncio.Task[tuple[int, str]]] = []
    pids: set[int] = set()
    async with _fresh() as client:
        async def call() -> tuple[int, str]:
            async with client.post(gateway.url + "/v1/chat/completions",
                                   json={**CHAT, "stream": True, "fake": held}) as response:
                return response.status, await response.text()

        async def held_by_both() -> bool:
            tasks.append(asyncio.create_task(call()))
            await await_until(lambda: fake.num_waiting("drain") == len(tasks), "the request held upstream")
            pids.add(int((await _scrape(client, gateway.url))["switchyard_process_id[]"]))
            return len(_process_prefixes(fake.stats()["request_ids"])) == 2 and len(pids) == 2
        await await_until(held_by_both, "requests held from both processes")

        gateway.send_signal(signal.SIGTERM)

        async def refused() -> bool:
            async with client.post(gateway.url + "/v1/chat/completions", json=CHAT) as response:
                return response.status == 503 and (await response.json())["error"]["code"] == "shutting_down"
        await await_until(refused, "new requests to be refused while draining")
        assert gateway.alive and not any(t.done() for t in tasks)

        fake.release("drain", len(tasks))
        results = await asyncio.gather(*tasks)
    assert all(status == 200 and text.rstrip().endswith("data: [DONE]") for status, text in results), results
    assert gateway.wait_exit() == 0
    assert not any(_alive(pid) for pid in pids)
