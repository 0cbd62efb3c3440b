"""KV tiers in a real worker process: a prefix the device pool evicted is served from host RAM or
disk (`cached_tokens` in the response's usage, the tier's counters in /load and /metrics), and a worker
restarted on the same --kv-disk-dir serves an earlier run's prefix from disk, and two workers share
a prefix through a real Mooncake master, then serve on when it dies. That restored KV gives
transformers' tokens is tests/backends/engine/test_kv_tiers.py's to show."""
from __future__ import annotations

import random
import urllib.request
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache.block_hash import block_hashes
from cache.kv_events import KvEventBatch
from cache.prefix_index import PrefixIndex
from gateway.routing.load import LoadReport
from gateway.routing.prefix_feed import on_load_report
from tests.support.mooncake import Master
from tests.support.wait import wait_until
from tests.support.worker_proc import WorkerProcess, supervised, worker_process

BLOCK = 16
POOL = ["--num-blocks", "12", "--max-num-seqs", "2"]   # 192 tokens: a few prompts evict each other


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/completions", data=orjson.dumps(body),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return orjson.loads(response.read())


def _get(url: str, path: str) -> bytes:
    with urllib.request.urlopen(url + path, timeout=10) as response:
        return response.read()


def _complete(url: str, prompt: list[int], max_tokens: int = 1) -> dict:
    return _post(url, {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


def _tier_metric(url: str, name: str) -> dict[str, float]:
    text = _get(url, "/metrics").decode()
    return {s.labels["medium"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def _evict(url: str, medium: str, at_least: int) -> None:
    """Fill the device pool with other prompts until `medium` holds `at_least` blocks."""
    for i in range(8):
        _complete(url, _tokens(1000 + i, 5 * BLOCK + 3))
        tiers = {t["medium"]: t for t in orjson.loads(_get(url, "/load"))["kv_tiers"]}
        if tiers[medium]["num_written_blocks"] >= at_least:
            break
    wait_until(lambda: {t["medium"]: t for t in orjson.loads(_get(url, "/load"))["kv_tiers"]}[medium]
               ["num_blocks"] >= at_least, f"{at_least} blocks in the {medium} tier")


def test_evicted_prefix_comes_back_from_ram_and_disk(tmp_path: Path) -> None:
    args = [*POOL, "--kv-cpu-gb", str(3 * 737_280 / 2**30), "--kv-disk-dir", str(tmp_path / "kv"),
            "--kv-disk-gb", "0.05"]
    shared = _tokens(1, 4 * BLOCK)
    with worker_process(["--model", "smollm2", *args], log_dir=tmp_path) as url:
        assert _cached(_complete(url, shared + _tokens(2, 7))) == 0
        _evict(url, "disk", 4)
        assert _cached(_complete(url, shared + _tokens(2, 7))) == 4 * BLOCK
        restored = _tier_metric(url, "switchyard_kv_tier_restored_blocks_total")
        assert sum(restored.values()) == 4 and restored["disk"] >= 1   # RAM spilled the oldest to disk
        capacity = _tier_metric(url, "switchyard_kv_tier_capacity_bytes")
        assert capacity["cpu"] > 0 and capacity["disk"] > 0
        seconds = _tier_metric(url, "switchyard_kv_tier_restore_seconds_total")
        assert all((seconds[m] > 0) == (n > 0) for m, n in restored.items())
        load = orjson.loads(_get(url, "/load"))
        assert load["num_free_blocks"] == load["num_total_blocks"]     # nothing leaked
        # Each medium's restore cost: its read-back time per token against the worker's measured compute of a
        # prompt token (None while a fit of its step times has not measured that), as the gateway reads it.
        per_token = load["seconds_per_prompt_token"]
        by_medium = {t["medium"]: t["restore_fraction"] for t in load["kv_tiers"]}
        for tier in load["kv_tiers"]:
            want = tier["restore_seconds"] / (tier["num_restored_blocks"] * BLOCK) / per_token if (
                per_token is not None and tier["num_restored_blocks"]) else None
            assert tier["restore_fraction"] == (None if want is None else pytest.approx(want))
        assert LoadReport.from_mapping(load).restore_fractions == (by_medium["cpu"], by_medium["disk"], None)


def test_a_restarted_worker_serves_the_last_runs_prefix_from_disk(tmp_path: Path) -> None:
    args = ["--model", "smollm2", *POOL, "--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-gb", "0.05"]
    shared = _tokens(7, 4 * BLOCK)
    with worker_process(args, log_dir=tmp_path) as url:
        assert _cached(_complete(url, shared + _tokens(8, 5))) == 0
        _evict(url, "disk", 4)
    with worker_process(args, log_dir=tmp_path) as url:
        assert {t["medium"]: t["num_blocks"] for t in orjson.loads(_get(url, "/load"))["kv_tiers"]}["disk"] >= 4
        assert _cached(_complete(url, shared + _tokens(8, 5))) == 4 * BLOCK


def test_a_prefix_computed_on_one_worker_is_used_by_another_through_the_store(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda (make setup)")
    master = Master(tmp_path)
    master.start()
    try:
        args = ["--model", "smollm2", *POOL, "--kv-store", master.url]
        shared = _tokens(11, 4 * BLOCK)
        starting = [WorkerProcess(args, log_dir=tmp_path, wait=False) for _ in range(2)]   # both load at once
        with supervised(starting[0]) as a, supervised(starting[1]) as b:
            assert _cached(_complete(a, shared + _tokens(12, 5))) == 0
            store_of = lambda url: {t["medium"]: t for t in orjson.loads(_get(url, "/load"))["kv_tiers"]}["store"]  # noqa: E731
            wait_until(lambda: store_of(a)["num_written_blocks"] >= 4, "worker A's prefix in the store")
            assert store_of(b)["up"]
            # Both name one store in /load; a gateway's index fed their reports and events credits B with A's blocks
            reports = {url: LoadReport.from_mapping(orjson.loads(_get(url, "/load"))) for url in (a, b)}
            assert reports[a].shared_store and reports[a].shared_store == reports[b].shared_store
            index = PrefixIndex()
            for url in (a, b):
                on_load_report(index, url, reports[url], BLOCK)
                index.apply_batch(url, KvEventBatch.from_mapping(orjson.loads(_get(url, "/kv_events?since=0"))))
            prompt = block_hashes(shared + _tokens(13, 9), BLOCK)
            assert index.matched_blocks_by_medium(prompt)[b] == (0, 0, 0, 4)
            assert _cached(_complete(b, shared + _tokens(13, 9))) == 4 * BLOCK
            assert store_of(b)["num_restored_blocks"] == 4
            assert store_of(a)["num_failed_writes"] == 0 == store_of(b)["num_failed_writes"]
            master.kill()                       # the store goes down: both workers serve on without it
            assert _cached(_complete(b, _tokens(14, 3 * BLOCK))) == 0
            assert _cached(_complete(a, _tokens(15, 3 * BLOCK))) == 0    # its lookup meets the outage
            wait_until(lambda: not store_of(a)["up"], "worker A noticing the outage")
            assert LoadReport.from_mapping(orjson.loads(_get(a, "/load"))).shared_store == ""   # a store it cannot read
            assert store_of(a)["num_outages"] >= 1
            assert _tier_metric(a, "switchyard_kv_tier_up")["store"] == 0
            failed = store_of(a)["num_failed_writes"]
            assert _cached(_complete(a, _tokens(16, 3 * BLOCK))) == 0    # 3 new blocks the store cannot keep
            wait_until(lambda: store_of(a)["num_failed_writes"] >= failed + 3, "worker A counting the missed writes")
            assert _tier_metric(a, "switchyard_kv_tier_failed_writes_total")["store"] >= failed + 3
    finally:
        master.kill()
