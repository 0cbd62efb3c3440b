"""KV tiers below the device pool (backends/kv_connectors/tiers) on the real SmolLM2: blocks the pool evicts are
written down to host RAM and disk, and a later prompt with the same prefix loads them back instead of
recomputing them. The tokens and logits after a restore are held to transformers' own forward and
greedy `generate`; a corrupt block is recomputed; no block leaks."""
from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from backends.core.block_events import CPU, DEVICE, DISK, STORE, KVEventKind
from backends.core.engine_config import EngineConfig
from backends.core.outputs import SequenceOutput
from backends.core.sampling_params import SamplingParams
from backends.engine.engine import LLMEngine
from backends.kv_connectors.tiers.connector import TieredKVConnector
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView
from tests.backends.engine.test_engine_model import hf_greedy, prompt, rel_err, tokens
from tests.backends.numerics import assert_mostly_clear, assert_same_tokens, choices, float64_copy, logit_tolerance
from tests.support.mooncake import Master
from tests.support.wait import wait_until

BLOCK = 16
POOL = 12            # device blocks: two 5-block prompts cannot both stay cached
BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4   # SmolLM2: 30 layers, K and V, 3 KV heads of 64, float32


@pytest.fixture
def make_engine(smollm2_runner: ModelRunner, smollm2_dir: Path) -> Iterator:
    engines: list[LLMEngine] = []

    def make(**kw: object) -> tuple[LLMEngine, RunnerView]:
        view = RunnerView(smollm2_runner, POOL)
        config = EngineConfig(model_dir=str(smollm2_dir), block_size=BLOCK, num_blocks=POOL, **kw)
        engine = LLMEngine(config, view, smollm2_dir)
        engines.append(engine)
        return engine, view

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[Master]:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda (make setup)")
    master = Master(tmp_path)
    master.start()
    yield master
    master.kill()


def tiers_of(engine: LLMEngine) -> TieredKVConnector:
    """The engine's tiers, through the one typed lookup the server uses for its P/D connector."""
    tiers = engine.find_kv_connector(TieredKVConnector)
    assert tiers is not None
    return tiers


def run_all(engine: LLMEngine, max_idle_waits: int = 200) -> dict[str, list[SequenceOutput]]:
    """Step until idle; a step that ran nothing (a sequence waits for its load) waits for the loader's
    wake-up instead of spinning."""
    woken = threading.Event()
    engine.set_wake(woken.set)
    outs: dict[str, list[SequenceOutput]] = {}
    idle = 0
    while engine.has_unfinished():
        steps = engine.num_steps
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if engine.num_steps == steps:
            idle += 1
            assert idle <= max_idle_waits and woken.wait(timeout=30), "a KV tier load never ended"
            woken.clear()
    return outs


def gated(method: Callable[[int, memoryview], bool], gate: threading.Event) -> Callable[[int, memoryview], bool]:
    """A tier method that waits for `gate` before it runs (a stuck disk, a slow read)."""
    def wait_then_call(block_hash: int, buf: memoryview) -> bool:
        gate.wait(timeout=30)
        return method(block_hash, buf)

    return wait_then_call


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def evict_prefix(engine: LLMEngine, medium: str, num_blocks: int,
                 make_prompt: Callable[[int, int], list[int]] = prompt) -> None:
    """Run small prompts until the first prompt's `num_blocks` leading blocks left the device pool (the
    least recently used go first, one or two a prompt), then wait until `medium` has taken each of them."""
    assert engine.find_kv_connector(TieredKVConnector) is not None
    prefix = first_cached(engine, num_blocks)
    for i in range(20):
        engine.add_request(f"filler{i}", make_prompt(100 + i, BLOCK + 3), greedy(1))
        run_all(engine)
        events = engine.kv_events.since(0, limit=10_000).events
        if prefix <= {e.block_hash for e in events if e.kind is KVEventKind.REMOVED and e.medium == "device"}:
            break
    else:
        raise AssertionError("the prefix stayed on device")
    wait_stored(engine, medium, prefix)


def first_cached(engine: LLMEngine, num_blocks: int) -> set[int]:
    """The first `num_blocks` blocks the engine cached on its device (a tier's events come between them)."""
    events = engine.kv_events.since(0, limit=10_000).events
    on_device = [e.block_hash for e in events if e.kind is KVEventKind.STORED and e.medium == DEVICE]
    return set(on_device[:num_blocks])


def wait_stored(engine: LLMEngine, medium: str, hashes: set[int]) -> None:
    """Wait until `medium` took each of these blocks. Not a count of its writes: the blocks evicted with the
    prefix (its prompt's tail goes first) are written too, and the prefix's own may still be queued."""
    def stored() -> bool:
        events = engine.kv_events.since(0, limit=10_000).events
        return hashes <= {e.block_hash for e in events if e.kind is KVEventKind.STORED and e.medium == medium}

    wait_until(stored, f"{len(hashes)} blocks written to {medium}")


@pytest.mark.parametrize("tiers", ["cpu", "disk", "cpu+disk", "store"])
def test_prefix_restored_from_a_tier_matches_transformers(make_engine, tmp_path: Path, tiers: str,
                                                          request: pytest.FixtureRequest,
                                                          hf_smollm2: torch.nn.Module,
                                                          hf_smollm2_f64: torch.nn.Module) -> None:
    kw: dict[str, object] = {}
    if "cpu" in tiers:   # cpu+disk: room for two blocks in RAM, the rest spills to disk
        kw["kv_cpu_bytes"] = (2 if "disk" in tiers else 64) * BLOCK_BYTES
    if "disk" in tiers:
        kw.update(kv_disk_dir=str(tmp_path), kv_disk_bytes=64 * (BLOCK_BYTES + 64))
    if tiers == "store":     # a real Mooncake master; every computed block is written through to it
        kw.update(kv_store=request.getfixturevalue("mooncake_master").url, kv_store_bytes=64 << 20)
    engine, runner = make_engine(**kw)
    if tiers == "store":     # the RAM it lends the store's pool is what it was given
        assert tiers_of(engine).store.segment_bytes == 64 << 20
    shared = prompt(1, 4 * BLOCK)
    first, second = shared + prompt(2, 7), shared + prompt(3, 5)
    engine.add_request("a", first, greedy(1))
    assert run_all(engine)["a"][-1].num_cached_tokens == 0
    evict_prefix(engine, "cpu" if tiers == "cpu+disk" else tiers, 4)

    engine.add_request("b", second, greedy(12))
    n_steps = len(runner.steps)
    out_b = run_all(engine)["b"]
    assert out_b[-1].num_cached_tokens == 4 * BLOCK
    restored = tiers_of(engine).restored
    assert sum(restored.values()) == 4 and set(restored) <= set(tiers.split("+"))
    if tiers == "cpu+disk":   # RAM holds two blocks: at least the prefix's tail spilled to disk
        assert restored[DISK] >= 2
    batch, logits = runner.steps[n_steps]
    assert batch.chunks[0].num_context_tokens == 4 * BLOCK and len(batch.chunks[0].token_ids) == 5
    with torch.inference_mode():
        ref = hf_smollm2(torch.tensor([second])).logits[0, -1].float()
    assert rel_err(logits[0], ref) < 1e-4
    (want, want_logits), = hf_greedy(hf_smollm2, [second], 12, engine.eos_token_ids)
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [second + want])
    reference = choices(want_logits, greedy(12), None, engine.eos_token_ids, tolerance)
    assert_mostly_clear([reference], "transformers' greedy tokens")
    assert_same_tokens(tokens(out_b), want, reference, "b")
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == POOL
    report = engine.load_report()
    assert {t.medium for t in report.kv_tiers} == set(tiers.split("+"))
    assert sum(t.num_restored_blocks for t in report.kv_tiers) == 4
    # What a restore cost: the tier's read-back time, and per token against the engine's measured compute of one
    # (from its steps of 1 to 71 rows; a loaded machine may leave that unmeasured, and the fraction with it).
    for tier in report.kv_tiers:
        n = tier.num_restored_blocks
        assert (tier.restore_seconds > 0) == (n > 0)
        fraction, = (t.restore_fraction for t in tiers_of(engine).load(0.001) if t.medium == tier.medium)
        if n == 0:
            assert fraction is None and tier.restore_fraction is None
            continue
        assert fraction == pytest.approx(tier.restore_seconds / (n * BLOCK) / 0.001)
        per_token = report.seconds_per_prompt_token
        assert tier.restore_fraction == (None if per_token is None else pytest.approx(fraction * 0.001 / per_token))
    engine.close()           # (again at teardown: idempotent) while a store's master is still up


def test_tier_events_name_their_medium(make_engine, tmp_path: Path) -> None:
    engine, _ = make_engine(kv_cpu_bytes=2 * BLOCK_BYTES, kv_disk_dir=str(tmp_path),
                            kv_disk_bytes=64 * (BLOCK_BYTES + 64))
    engine.add_request("a", prompt(1, 4 * BLOCK + 7), greedy(1))
    run_all(engine)
    evict_prefix(engine, CPU, 2)   # RAM took the prefix's two blocks last (a prompt's tail is evicted first) and
    events = engine.kv_events.since(0, limit=10_000).events    # had spilled the two before them to disk
    kinds = {(e.kind, e.medium) for e in events}
    assert {(KVEventKind.STORED, "device"), (KVEventKind.REMOVED, "device"), (KVEventKind.STORED, CPU),
            (KVEventKind.REMOVED, CPU), (KVEventKind.STORED, DISK)} <= kinds
    # A block RAM evicted went to disk: its REMOVED(cpu) follows its STORED(disk).
    spilled = [e.block_hash for e in events if e.kind is KVEventKind.REMOVED and e.medium == CPU]
    on_disk = {e.block_hash for e in events if e.kind is KVEventKind.STORED and e.medium == DISK}
    assert spilled and set(spilled) <= on_disk


def test_corrupt_disk_block_is_recomputed(make_engine, tmp_path: Path, hf_smollm2: torch.nn.Module) -> None:
    engine, runner = make_engine(kv_disk_dir=str(tmp_path), kv_disk_bytes=64 * (BLOCK_BYTES + 64))
    shared = prompt(1, 4 * BLOCK)
    engine.add_request("a", shared + prompt(2, 7), greedy(1))
    run_all(engine)
    evict_prefix(engine, DISK, 4)
    disk = tiers_of(engine).local[0]
    second_block = disk._path(engine.kv_events.since(0).events[1].block_hash)
    data = bytearray(second_block.read_bytes())
    data[len(data) // 2] ^= 0xFF
    second_block.write_bytes(bytes(data))

    second = shared + prompt(3, 5)
    engine.add_request("b", second, greedy(1))
    n_steps = len(runner.steps)
    out_b = run_all(engine)["b"]
    assert out_b[-1].num_cached_tokens == BLOCK          # the first block restored, the rest recomputed
    assert disk.num_corrupt == 1 and not second_block.exists()
    batch, logits = runner.steps[n_steps]
    assert batch.chunks[0].num_context_tokens == BLOCK
    with torch.inference_mode():
        ref = hf_smollm2(torch.tensor([second])).logits[0, -1].float()
    assert rel_err(logits[-1], ref) < 1e-4
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == POOL


@pytest.mark.parametrize("tier", [DISK, STORE])
def test_other_weights_in_a_folder_of_the_same_name_never_read_their_blocks(
        make_engine, smollm2_dir: Path, smollm2_revision_dir: Path, tmp_path: Path, tier: str,
        request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:
    """A disk tier outlives its worker, and a store is shared by every worker that names it, so a worker may
    meet blocks that other weights computed: a fine-tune or a new revision, in a folder of the same name (a
    rolling upgrade). It must not read them (its tokens would then follow KV its own weights never produced).
    Blocks are filed under the weights' fingerprint, not the folder's name: the other weights recompute the
    prefix and match transformers on themselves, and the first weights still read the blocks back."""
    from transformers import LlamaForCausalLM

    if tier == DISK:
        kw: dict[str, object] = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_bytes": 64 * (BLOCK_BYTES + 64)}
    else:   # a real Mooncake master; the first engine stays up: its blocks live in the RAM it lends the store
        kw = {"kv_store": request.getfixturevalue("mooncake_master").url}
    engine, _ = make_engine(**kw)
    shared = prompt(1, 4 * BLOCK)
    engine.add_request("a", shared + prompt(2, 7), greedy(1))
    run_all(engine)
    if tier == DISK:
        evict_prefix(engine, DISK, 4)
        engine.close()   # the files outlive it
    else:       # written through as they are computed
        wait_stored(engine, STORE, first_cached(engine, 4))

    other_dir = smollm2_revision_dir
    assert other_dir.name == smollm2_dir.name
    other_runner = ModelRunner(other_dir, dtype=torch.float32, device="cpu", num_blocks=POOL, block_size=BLOCK,
                               fingerprint_weights=True)
    assert other_runner.weights_fingerprint != engine.runner.weights_fingerprint
    view = RunnerView(other_runner)
    with caplog.at_level(logging.WARNING, logger="backends.kv_connectors.tiers.disk"):
        other = LLMEngine(EngineConfig(model_dir=str(other_dir), block_size=BLOCK, num_blocks=POOL, **kw), view,
                          other_dir)
    if tier == DISK:   # the first weights' files stay (another worker may use them); the worker says what they hold
        held = re.search(r"also holds (\d+) blocks .* of 1 other namespaces", caplog.text)
        assert held is not None and int(held.group(1)) >= 4
    try:
        second = shared + prompt(3, 5)
        other.add_request("b", second, greedy(8))
        out_b = run_all(other)["b"]
        assert out_b[-1].num_cached_tokens == 0 and sum(tiers_of(other).restored.values()) == 0
        hf_other = LlamaForCausalLM.from_pretrained(str(other_dir), dtype=torch.float32).eval()
        (want, want_logits), = hf_greedy(hf_other, [second], 8, other.eos_token_ids)
        tolerance = logit_tolerance(hf_other, float64_copy(hf_other), [second + want])
        reference = choices(want_logits, greedy(8), None, other.eos_token_ids, tolerance)
        assert_mostly_clear([reference], "transformers' greedy tokens on the other weights")
        assert_same_tokens(tokens(out_b), want, reference, "b on the other weights")
        other.block_manager.check_invariants()
    finally:
        other.close()

    # The first weights in a new engine (an empty device pool): the blocks are there, and read back.
    again, _ = make_engine(**kw)
    again.add_request("c", second, greedy(1))
    assert run_all(again)["c"][-1].num_cached_tokens == 4 * BLOCK
    assert tiers_of(again).restored[tier] == 4
    again.close()
    engine.close()           # (again at teardown: idempotent) while a store's master is still up


def test_abort_during_a_load_frees_its_blocks_once_the_load_ends(make_engine) -> None:
    engine, _ = make_engine(kv_cpu_bytes=64 * BLOCK_BYTES)
    shared = prompt(1, 4 * BLOCK)
    engine.add_request("a", shared + prompt(2, 7), greedy(1))
    run_all(engine)
    evict_prefix(engine, CPU, 4)
    cpu = tiers_of(engine).local[0]
    release = threading.Event()
    cpu.get = gated(cpu.get, release)
    engine.add_request("b", shared + prompt(3, 5), greedy(4))
    engine.step()                                   # admitted; its load waits in the loader thread
    assert engine.scheduler.waiting_for_remote_kv
    assert engine.abort_request("b") is not None
    assert engine.block_manager.num_free_blocks < POOL, "blocks a load still writes were freed"
    release.set()
    wait_until(lambda: engine.step() is not None and engine.block_manager.num_free_blocks == POOL,
               "the aborted load's blocks freed")
    engine.block_manager.check_invariants()


def test_a_full_write_queue_drops_blocks_instead_of_waiting(make_engine) -> None:
    engine, _ = make_engine(kv_cpu_bytes=64 * BLOCK_BYTES, kv_write_queue_blocks=1)
    cpu = tiers_of(engine).local[0]
    release = threading.Event()
    cpu.put = gated(cpu.put, release)
    engine.add_request("a", prompt(1, 4 * BLOCK + 7), greedy(1))
    run_all(engine)
    for i in range(2):                               # evicts cached blocks while the writer is stuck
        engine.add_request(f"filler{i}", prompt(100 + i, 5 * BLOCK + 3), greedy(1))
        run_all(engine)
    events = engine.kv_events.since(0, limit=10_000).events
    evicted = sum(e.kind is KVEventKind.REMOVED and e.medium == "device" for e in events)
    assert evicted >= 3 and tiers_of(engine).num_dropped_writes == evicted - 1   # one fits the queue
    release.set()
    wait_until(lambda: tiers_of(engine).written[CPU] >= 1, "the one queued block written")
    assert engine.load_report().num_kv_dropped_writes == tiers_of(engine).num_dropped_writes


def test_nothing_is_copied_out_for_a_store_that_is_down(make_engine) -> None:
    """A store the worker cannot reach: the blocks it computes are not copied out of the device pool for puts
    that would fail, and each one counts as a write the store missed."""
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda (make setup)")
    with socket.socket() as probe:          # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine, _ = make_engine(kv_store=f"mooncake://127.0.0.1:{port}")
    assert not tiers_of(engine).store.is_up
    copied: list[int] = []
    read = tiers_of(engine).block_io.read
    tiers_of(engine).block_io.read = lambda block_id, buf: (copied.append(block_id), read(block_id, buf))[1]
    engine.add_request("a", prompt(1, 3 * BLOCK + 5), greedy(1))
    run_all(engine)
    failed, = (t.num_failed_writes for t in engine.load_report().kv_tiers if t.medium == STORE)
    assert copied == [] and failed == 3      # the prompt's three whole blocks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_io_copies_one_block_of_every_layer(device: str, dtype: torch.dtype) -> None:
    from backends.kv_connectors.tiers.block_io import BlockIO

    stacked = torch.randn(3, 2, 5, 4, 2, 8).to(device=device, dtype=dtype)   # layers, K/V, blocks, tokens, heads, dim
    io = BlockIO(stacked)
    assert io.block_nbytes == 3 * 2 * 4 * 2 * 8 * stacked.element_size()
    buf = io.buffer()
    io.wait(io.read(3, buf))
    before = stacked.clone()
    io.begin_writes()
    io.wait(io.write(1, buf))
    assert torch.equal(stacked[:, :, 1], before[:, :, 3])
    others = [b for b in range(5) if b != 1]
    assert torch.equal(stacked[:, :, others], before[:, :, others])


def test_a_borrowed_ram_slot_is_not_reused_until_released() -> None:
    from backends.kv_connectors.tiers.cpu import CpuTier

    tier = CpuTier(2 * 8, 8)          # two slots of 8 bytes
    for h in (1, 2):
        assert tier.put(h, memoryview(bytes([h]) * 8))
    (one, release_one), (two, release_two) = tier.borrow(1), tier.borrow(2)
    assert tier.borrow(9) is None
    assert not tier.put(3, memoryview(b"\x03" * 8))      # both slots are lent: nothing can go
    assert bytes(one) == b"\x01" * 8 and bytes(two) == b"\x02" * 8
    release_one()
    assert tier.put(3, memoryview(b"\x03" * 8))          # the released slot is reused
    assert tier.leading_hits([1]) == 0 and tier.leading_hits([2]) == 1 and bytes(two) == b"\x02" * 8
    release_two()
