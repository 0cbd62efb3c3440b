"""DeepseekV3ForCausalLM (the Kimi K2 architecture) against transformers' own forward and generate on the same
weights: a tiny random model with latent attention (q_lora_rank set and None), YaRN rotary, a dense first layer
and sparse layers (8 experts, top-2, 2 groups of which 1 is kept, a shared expert, the correction bias).

Our runner's logits must lie within the float32 rounding measured in the same run (tests/backends/numerics.py):
whole prefill, uneven chunks, token-by-token decode, a mixed batch, a prefix-cache hit; greedy tokens through
LLMEngine equal transformers' generate; the paged cache holds the compressed latent (its bytes per token); a
decode runner that pulls a prefill runner's latent blocks over the KV transfer's TCP transport goes on with
transformers' logits (P/D); n-gram speculative decoding keeps transformers' greedy tokens; a prefix's latent blocks
restored from the host-RAM or the disk KV tier give transformers' logits and tokens.
"""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from backends.core.batch import ForwardBatch, SeqChunk
from backends.core.block_events import CPU, DISK
from backends.core.engine_config import EngineConfig
from backends.core.kv_transfer_params import RemoteBlocks
from backends.core.sampling_params import SamplingParams
from backends.engine.engine import LLMEngine
from backends.kv_connectors.tiers.connector import TieredKVConnector
from backends.kv_transfer import TcpTransport
from backends.kv_transfer.torch_cache import TorchPagedKV
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView
from tests.backends.engine.test_engine_model import hf_greedy
from tests.backends.engine.test_kv_tiers import evict_prefix, run_all as run_with_tiers
from tests.backends.models.moe_checkpoints import TINY_DEEPSEEK_V3, tiny_deepseek_v3
from tests.backends.numerics import (
    assert_mostly_clear,
    assert_same_tokens,
    choices,
    float64_copy,
    logit_tolerance,
)

BLOCK = 4
VOCAB = 97
TINY = TINY_DEEPSEEK_V3


def tokens_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


@pytest.fixture(scope="module", params=[48, None], ids=["q_lora", "q_full"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(f"deepseek-v3-{request.param}")
    reference = tiny_deepseek_v3(folder, request.param)
    # fingerprinted: a disk tier files its blocks under the weights' digest
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=64, block_size=BLOCK,
                         fingerprint_weights=True)
    rows = [tokens_of(40, seed) for seed in (1, 2, 3)]
    tolerance = logit_tolerance(reference, float64_copy(reference), rows)
    return runner, reference, tolerance, folder


def reference_logits(reference: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([tokens])).logits[0].float()  # [len(tokens), vocab]


def close(ours: torch.Tensor, ref: torch.Tensor, tolerance: float) -> bool:
    return (ours.float() - ref.float()).abs().max().item() <= tolerance


def test_prefill_chunks_and_decode_match_transformers(tiny) -> None:
    runner, reference, tolerance, _ = tiny
    tokens = tokens_of(40, 1)
    ref = reference_logits(reference, tokens)
    table = tuple(random.Random(7).sample(range(runner.num_blocks), 10))   # shuffled blocks
    whole = runner.execute(ForwardBatch((SeqChunk(tuple(tokens), 0, table),)))
    assert close(whole[0], ref[-1], tolerance)
    table = table[::-1]
    for start, end in itertools.pairwise([0, 14, 25, 40]):   # uneven chunks over the cached latent
        out = runner.execute(ForwardBatch((SeqChunk(tuple(tokens[start:end]), start, table),)))
        assert close(out[0], ref[end - 1], tolerance), (start, end)
    runner.execute(ForwardBatch((SeqChunk(tuple(tokens[:3]), 0, table, want_logits=False),)))
    for pos in range(3, 40):
        out = runner.execute(ForwardBatch((SeqChunk((tokens[pos],), pos, table),)))
        assert close(out[0], ref[pos], tolerance), pos


def test_mixed_batch_matches_transformers(tiny) -> None:
    """A prefills its second chunk while B and C decode, in one step."""
    runner, reference, tolerance, _ = tiny
    seqs = [tokens_of(n, 10 + i) for i, n in enumerate((19, 9, 14))]
    refs = [reference_logits(reference, s) for s in seqs]
    free = random.Random(3).sample(range(runner.num_blocks), 15)
    tables = [tuple(free[:5]), tuple(free[5:8]), tuple(free[8:12])]
    a, b, c = seqs
    runner.execute(ForwardBatch((SeqChunk(tuple(a[:9]), 0, tables[0], want_logits=False),
                                 SeqChunk(tuple(b[:-1]), 0, tables[1], want_logits=False),
                                 SeqChunk(tuple(c[:-1]), 0, tables[2], want_logits=False))))
    out = runner.execute(ForwardBatch((SeqChunk((b[-1],), len(b) - 1, tables[1]),
                                       SeqChunk(tuple(a[9:]), 9, tables[0]),
                                       SeqChunk((c[-1],), len(c) - 1, tables[2]))))
    for row, (ref, seq) in enumerate(((refs[1], b), (refs[0], a), (refs[2], c))):
        assert close(out[row], ref[len(seq) - 1], tolerance), row


def test_cache_holds_the_compressed_latent(tiny) -> None:
    """Per token and layer the cache keeps c_kv and k_pe (32 + 16 channels, half in K, half in V), not 4 heads
    of K (48) and V (32): 48 of 320 elements, 15%; DeepSeek-V3's dims give 576 of 40,960, 1.4%."""
    runner, _, _, _ = tiny
    spec = runner.kv_cache.spec
    latent = spec.bytes_per_block // (spec.block_size * spec.num_layers * 4)   # float32 elements per token-layer
    expanded = TINY["num_attention_heads"] * (TINY["qk_nope_head_dim"] + TINY["qk_rope_head_dim"]
                                              + TINY["v_head_dim"])
    assert latent == TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"] == 48
    assert latent * 4 <= expanded
    assert 576 * 4 <= 128 * (128 + 64 + 128)


def engine_for(runner: ModelRunner, folder: Path, **kw: object) -> LLMEngine:
    config = EngineConfig(model_dir=str(folder), block_size=BLOCK, num_blocks=runner.num_blocks, **kw)
    return LLMEngine(config, RunnerView(runner), folder)


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outs.setdefault(output.request_id, []).extend(output.new_token_ids)
    return outs


def test_greedy_tokens_equal_transformers_generate(tiny) -> None:
    """Three prompts batched and chunked (a budget of 16 tokens a step) through LLMEngine."""
    runner, reference, tolerance, folder = tiny
    engine = engine_for(runner, folder, max_num_batched_tokens=16)
    prompts = {f"p{i}": tokens_of(21, 30 + i) for i in range(3)}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy)
    outs = run_all(engine)
    with torch.inference_mode():
        out = reference.generate(torch.tensor(list(prompts.values())), max_new_tokens=12, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    logits = torch.stack(out.logits, dim=1).float()   # [prompts, steps, vocab]
    refs = [choices(logits[i], greedy, None, engine.eos_token_ids, tolerance) for i in range(3)]
    assert_mostly_clear(refs, "transformers' greedy tokens")
    for i, rid in enumerate(prompts):
        assert_same_tokens(outs[rid], out.sequences[i, 21:].tolist(), refs[i], rid)


def test_ngram_speculation_keeps_transformers_greedy_tokens(tiny) -> None:
    """Prompt lookup drafts up to four tokens a step; verifying them runs each sequence's drafts through latent
    attention over its cached latent and through the experts together. The prompts repeat a phrase so that
    lookups find drafts: drafts are verified and some accepted, and the tokens stay transformers' greedy ones."""
    runner, reference, tolerance, folder = tiny
    view = RunnerView(runner)
    engine = LLMEngine(EngineConfig(model_dir=str(folder), block_size=BLOCK, num_blocks=runner.num_blocks,
                                    speculative="ngram", num_speculative_tokens=4, spec_adaptive=False),
                       view, folder)
    prompts = {f"s{i}": (tokens_of(6, 50 + i) * 4)[:22] for i in range(3)}
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy)
    outs = run_all(engine)
    assert any(c.num_logits > 1 for batch, _ in view.steps for c in batch.chunks), "no step verified drafts"
    assert engine.stats().num_spec_accepted_tokens > 0, engine.stats()
    expected = hf_greedy(reference, list(prompts.values()), 16, (-1,))
    refs = [choices(logits, greedy, None, (), tolerance) for _, logits in expected]
    assert_mostly_clear(refs, "transformers' greedy tokens")
    for rid, (want, _), ref in zip(prompts, expected, refs, strict=True):
        assert_same_tokens(outs[rid], want, ref, rid)
    engine.close()


def test_prefix_cache_hit_gives_transformers_logits(tiny) -> None:
    """A second prompt sharing three blocks reads their latent from the cache: the hit is counted, and the step that
    computes only its last six tokens gives transformers' logits (the cold run's, within the rounding)."""
    runner, reference, tolerance, folder = tiny
    view = RunnerView(runner)
    engine = LLMEngine(EngineConfig(model_dir=str(folder), block_size=BLOCK, num_blocks=runner.num_blocks),
                       view, folder)
    shared = tokens_of(3 * BLOCK, 40)
    first, second = shared + tokens_of(5, 41), shared + tokens_of(6, 42)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request("a", first, one)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", second, one)
    num_steps = len(view.steps)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert outputs[-1].num_cached_tokens == 3 * BLOCK
    batch, logits = view.steps[num_steps]
    assert batch.chunks[0].num_context_tokens == 3 * BLOCK and len(batch.chunks[0].token_ids) == 6
    assert close(logits[0], reference_logits(reference, second)[-1], tolerance)


async def test_latent_blocks_pulled_over_tcp_decode_as_transformers(tiny) -> None:
    """P/D: a second runner (the decode worker) pulls the prefill runner's latent blocks over the TCP transport,
    then decodes from them; its logits are transformers'. The blocks moved are the latent's, not expanded K/V."""
    prefill, reference, tolerance, folder = tiny
    decode = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=16, block_size=BLOCK)
    tokens = tokens_of(22, 60)
    ref = reference_logits(reference, tokens)
    held, pulled = (3, 9, 4, 20, 21), (7, 2, 11, 5, 6)
    prefill.execute(ForwardBatch((SeqChunk(tuple(tokens[:20]), 0, held, want_logits=False),)))
    source = TorchPagedKV(list(zip(prefill.kv_cache.k, prefill.kv_cache.v, strict=True)))
    sink = TorchPagedKV(list(zip(decode.kv_cache.k, decode.kv_cache.v, strict=True)))
    server = TcpTransport()
    _, port = await server.serve(source, "127.0.0.1", 0)
    try:
        source.holds.hold("latent", list(held))
        result = await TcpTransport().pull(RemoteBlocks(host="127.0.0.1", port=port, transfer_id="latent",
                                                        num_blocks=len(held)), sink, list(pulled))
    finally:
        await server.close()
    spec = prefill.kv_cache.spec
    assert result.num_bytes == len(held) * spec.bytes_per_block   # 48 channels a token and layer
    table = (*pulled, 12)   # the pulled blocks hold positions 0-19; a fresh block takes the decodes
    for pos in (20, 21):
        out = decode.execute(ForwardBatch((SeqChunk((tokens[pos],), pos, table),)))
        assert close(out[0], ref[pos], tolerance), pos


@pytest.mark.parametrize("medium", [CPU, DISK])
def test_prefix_restored_from_a_tier_gives_transformers_tokens(tiny, medium: str, tmp_path: Path) -> None:
    """A prefix's latent blocks, evicted from a pool of 12 blocks down to the host-RAM tier (EngineConfig.kv_cpu_bytes,
    --kv-cpu-gb) or the disk tier (kv_disk_dir, --kv-disk-dir) and read back from it: the step after the restore
    gives transformers' logits, the sequence its greedy tokens, and every block is free after."""
    runner, reference, tolerance, folder = tiny
    pool, block_bytes = 12, runner.kv_cache.spec.bytes_per_block
    tier: dict[str, object] = ({"kv_cpu_bytes": 64 * block_bytes} if medium == CPU else
                               {"kv_disk_dir": str(tmp_path), "kv_disk_bytes": 64 * (block_bytes + 64)})
    view = RunnerView(runner, pool)
    engine = LLMEngine(EngineConfig(model_dir=str(folder), block_size=BLOCK, num_blocks=pool,
                                    kv_read_slower_tiers=True, **tier), view, folder)
    try:
        shared = tokens_of(4 * BLOCK, 70)
        second = shared + tokens_of(5, 72)
        engine.add_request("a", shared + tokens_of(7, 71), SamplingParams(max_tokens=1, temperature=0.0))
        run_with_tiers(engine)
        evict_prefix(engine, medium, 4, lambda seed, n: tokens_of(n, seed))
        greedy = SamplingParams(max_tokens=12, temperature=0.0)
        engine.add_request("b", second, greedy)
        num_steps = len(view.steps)
        out = run_with_tiers(engine)["b"]
        assert out[-1].num_cached_tokens == 4 * BLOCK
        assert engine.find_kv_connector(TieredKVConnector).restored == {medium: 4}
        batch, logits = view.steps[num_steps]
        assert batch.chunks[0].num_context_tokens == 4 * BLOCK and len(batch.chunks[0].token_ids) == 5
        assert close(logits[0], reference_logits(reference, second)[-1], tolerance)
        (want, want_logits), = hf_greedy(reference, [second], 12, engine.eos_token_ids)
        ref = choices(want_logits, greedy, None, engine.eos_token_ids, tolerance)
        assert_mostly_clear([ref], "transformers' greedy tokens")
        assert_same_tokens([t for o in out for t in o.new_token_ids], want, ref, f"restored from {medium}")
        engine.block_manager.check_invariants()
        assert engine.block_manager.num_free_blocks == pool
    finally:
        engine.close()
