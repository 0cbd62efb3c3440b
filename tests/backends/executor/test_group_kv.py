"""A group's KV leaving its ranks, on the CPU (gloo, the tiny random Llama of test_tensor_parallel_served.py): rank
0 reaches every rank's blocks through their shared-memory caches (backends/executor/group_kv.py).

Prefill/decode disaggregation: a TP=2 prefill worker hands its KV to a TP=2 decode worker, each rank's shard to
its peer's, and two pipeline stages to two stages, each stage's layers to its peer's:
- the decode leg's tokens are the unified single-rank worker's and transformers' greedy ones, directly and through
  the gateway's switchyard-pd provider over pools of both shapes (it pairs a prefill worker with a decode worker
  of the same weights fingerprint, which names the group's shape);
- the decode group receives the prefill group's bytes exactly (per-block digests of every rank's layers);
- a pair of different shapes is refused with both layouts, and no block is left held or allocated.

KV tiers: a TP=2 worker serves a prefix its device pool evicted from host RAM, and a PP=2 worker restarted on the
same --kv-disk-dir serves the last run's from disk (the group's weights fingerprint, which names the disk's
namespace, is the same on every start), with the tokens it gave when it computed the prefix.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedModel

from tests.backends.executor.test_tensor_parallel_served import STORY, Served, hf_reference
from tests.backends.executor.tp_checkpoints import tiny_llama
from tests.backends.numerics import assert_same_tokens, float64_copy
from tests.backends.pd_http import assert_idle, get, post
from tests.backends.references import prompt_ids, smollm2_vocabulary
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import await_until
from tests.support.worker_proc import WorkerProcess, started_workers

pytestmark = pytest.mark.slow

NAME = "tiny-llama"
HOLD_TIMEOUT_S = 8.0   # an unclaimed or refused hold is released after this at the latest
COMMON = ["--threads", "1", "--num-blocks", "64", "--served-model-name", NAME, "--debug-endpoints",
          "--kv-hold-timeout-s", str(HOLD_TIMEOUT_S)]
SHAPES = {"tp2": ["--tensor-parallel-size", "2"], "pp2": ["--pipeline-parallel-size", "2"]}
BODY = {"model": NAME, "prompt": STORY, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}


@dataclass(frozen=True)
class Pools:
    folder: Path
    model: PreTrainedModel
    workers: dict[str, WorkerProcess]   # "one" (unified, one rank), "prefill-tp2", "decode-tp2", "prefill-pp2"...

    def url(self, name: str) -> str:
        return self.workers[name].url

    def reference(self) -> Served:
        return Served(self.folder, self.model, float64_copy(self.model), self.workers)


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_llama(folder)
    args = {"one": ["--model", str(folder), *COMMON],
            **{f"{role}-{shape}": ["--model", str(folder), "--role", role, *flags, *COMMON]
               for shape, flags in SHAPES.items() for role in ("prefill", "decode")}}
    with started_workers(args, tmp_path_factory.mktemp("pd-groups")) as workers:
        yield Pools(folder, model, workers)


async def prefill(url: str) -> dict[str, Any]:
    status, answer = await post(url, {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, answer
    return answer


async def digests(url: str, transfer_id: str) -> dict[str, Any]:
    return await get(f"{url}/debug/kv_digest?transfer_id={transfer_id}")


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_groups_kv_moves_to_a_group_of_its_shape(pools: Pools, shape: str) -> None:
    tokenizer, _ = smollm2_vocabulary()
    prompt = prompt_ids(tokenizer, BODY, chat=False)
    want, reference = hf_reference(pools.reference(), prompt, BODY["max_tokens"])
    status, unified = await post(pools.url("one"), BODY)
    assert status == 200, unified
    assert_same_tokens(unified["choices"][0]["token_ids"], want, reference, "one rank against transformers")

    pre = await prefill(pools.url(f"prefill-{shape}"))
    kv = pre["kv_transfer_params"]
    assert len(kv["remote_block_ids"]) == -(-len(prompt) // 16) > 1   # a few blocks, the last one partial
    held = (await digests(pools.url(f"prefill-{shape}"), kv["remote_request_id"]))["held"]
    status, dec = await post(pools.url(f"decode-{shape}"), {**BODY, "kv_transfer_params": {**kv,
                                                                                            "response_id": pre["id"]}})
    assert status == 200, dec
    assert kv["first_token_ids"] + dec["choices"][0]["token_ids"] == unified["choices"][0]["token_ids"]
    received = await digests(pools.url(f"decode-{shape}"), kv["remote_request_id"])
    assert received["received"]["digests"] == held[received["received"]["start_block"]:]   # every rank's bytes
    assert received["totals"]["pulls"] >= 1 and received["totals"]["shared_memory_pulls"] == 0, received["totals"]
    await assert_idle([pools.url(f"prefill-{shape}"), pools.url(f"decode-{shape}")])


async def test_a_pair_of_different_shapes_is_refused_with_both_layouts(pools: Pools) -> None:
    pre = await prefill(pools.url("prefill-tp2"))
    status, dec = await post(pools.url("decode-pp2"), {**BODY, "kv_transfer_params": {
        **pre["kv_transfer_params"], "response_id": pre["id"]}})
    assert status == 400, dec
    assert dec["error"]["code"] == "kv_transfer_mismatch", dec
    # the prefill group answers the pull: its 2 layers x 2 ranks of one KV head each, the stages' 2 of both heads
    assert "num_layers: 4 here vs 2 at the peer; num_kv_heads: 1 here vs 2 at the peer" in dec["error"]["message"], dec
    assert "tp2-pp1-" in dec["error"]["message"] and "tp1-pp2-" in dec["error"]["message"], dec
    await assert_idle([pools.url("prefill-tp2"), pools.url("decode-pp2")])   # the refused hold is released


async def test_the_gateway_pairs_each_prefill_group_with_a_decode_group_of_its_shape(pools: Pools,
                                                                                    tmp_path: Path) -> None:
    status, unified = await post(pools.url("one"), BODY)
    assert status == 200, unified
    provider = {"kind": "switchyard-pd", "prefill_endpoints": [pools.url(f"prefill-{s}") for s in SHAPES],
                "endpoints": [pools.url(f"decode-{s}") for s in SHAPES], "offers_load": True,
                "offers_token_ids": True}
    gateway = GatewayProcess({"models": {NAME: {"tokenizer": str(pools.folder), "providers": ["pd"]}},
                              "providers": {"pd": provider}}, tmp_path, start_timeout_s=120)
    async def pulls() -> int:
        return sum([(await digests(pools.url(f"decode-{s}"), "-"))["totals"]["pulls"] for s in SHAPES])

    async def loads_polled() -> bool:   # the gateway pairs by the fingerprints the workers' /load reports
        rows = (await get(gateway.url + "/status.json"))["endpoints"]
        return len(rows) == 4 and all(r["healthy"] and r["kv_used_fraction"] is not None for r in rows)
    try:
        await await_until(loads_polled, "the gateway to have every worker's /load")
        before = await pulls()
        for _ in range(4):   # both shapes' prefill workers take some of them
            status, answer = await post(gateway.url, BODY)
            assert status == 200, answer
            assert answer["choices"][0]["token_ids"] == unified["choices"][0]["token_ids"]
    finally:
        gateway.stop()
    assert await pulls() - before == 4   # every answer came through a transfer, none refused and computed again
    await assert_idle([w.url for w in pools.workers.values()])


BLOCK = 16
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4   # layers x (K, V) x tokens x KV heads x head_dim x float32, all ranks'
TIERED = ["--num-blocks", "12", "--max-num-seqs", "2", "--threads", "1", "--served-model-name", NAME]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


async def complete(url: str, prompt: list[int]) -> tuple[list[int], int]:
    """The greedy tokens after `prompt`, and how many of its tokens came from a cache."""
    status, answer = await post(url, {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                                      "return_token_ids": True})
    assert status == 200, answer
    return answer["choices"][0]["token_ids"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def evict(url: str, medium: str, at_least: int) -> None:
    """Fill the device pool with other prompts until `medium` holds `at_least` blocks."""
    async def held() -> bool:
        return {t["medium"]: t for t in (await get(url + "/load"))["kv_tiers"]}[medium]["num_blocks"] >= at_least
    for i in range(8):
        if await held():
            return
        await complete(url, tokens(1000 + i, 5 * BLOCK + 3))
    assert await held(), await get(url + "/load")


async def test_a_tp2_worker_serves_an_evicted_prefix_from_ram(pools: Pools, tmp_path: Path) -> None:
    shared, tail = tokens(1, 4 * BLOCK), tokens(2, 7)
    worker = WorkerProcess(["--model", str(pools.folder), "--tensor-parallel-size", "2", *TIERED,
                            "--kv-cpu-gb", str(64 * BLOCK_BYTES / 2**30)], log_dir=tmp_path)   # room for every prompt
    try:
        first, cached = await complete(worker.url, shared + tail)
        assert cached == 0
        await evict(worker.url, "cpu", 4)
        again, cached = await complete(worker.url, shared + tail)
        assert cached == 4 * BLOCK and again == first   # every rank's shard came back
        one, _ = await complete(pools.url("one"), shared + tail)
        assert first == one
        load = await get(worker.url + "/load")
        assert {t["medium"]: t["num_restored_blocks"] for t in load["kv_tiers"]}["cpu"] == 4, load
        assert load["num_free_blocks"] == load["num_total_blocks"], load   # nothing leaked
    finally:
        worker.stop()


async def test_a_restarted_pp2_worker_serves_the_last_runs_prefix_from_disk(pools: Pools, tmp_path: Path) -> None:
    shared, tail = tokens(7, 4 * BLOCK), tokens(8, 5)
    args = ["--model", str(pools.folder), "--pipeline-parallel-size", "2", *TIERED, "--kv-disk-dir",
            str(tmp_path / "kv"), "--kv-disk-gb", "0.01"]
    worker = WorkerProcess(args, log_dir=tmp_path)
    try:
        first, cached = await complete(worker.url, shared + tail)
        assert cached == 0
        await evict(worker.url, "disk", 4)
    finally:
        worker.stop()
    worker = WorkerProcess(args, log_dir=tmp_path)
    try:
        again, cached = await complete(worker.url, shared + tail)
        assert cached == 4 * BLOCK and again == first
    finally:
        worker.stop()
