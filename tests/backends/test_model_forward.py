"""Our paged forward against transformers' own forward on the same weights (float32, 1e-4 relative).

Tiny random models of each supported shape (MHA, GQA + tied, Qwen2 biases, Qwen3 q/k norms, llama3
rope scaling) and the bundled SmolLM2: whole prefill, chunked prefill, token-by-token decode, and a
mixed batch with shuffled block tables.
"""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from backends.core.batch import ForwardBatch, SeqChunk
from backends.worker.model_runner import ModelRunner
from tests.backends.numerics import logit_tolerance

TOLERANCE = 1e-4
_TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)
TINY_MODELS = {
    "llama-mha": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa-tied": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                            tie_word_embeddings=True, rope_theta=500.0)),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3-qknorm": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def shuffled_table(rng: random.Random, free: list[int], num_blocks: int) -> tuple[int, ...]:
    """Non-contiguous blocks taken at random from `free` (removed from it)."""
    picked = rng.sample(free, num_blocks)
    for block in picked:
        free.remove(block)
    return tuple(picked)


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    config_cls, model_cls, extra = TINY_MODELS[request.param]
    torch.manual_seed(0)
    reference = model_cls(config_cls(**_TINY, **extra)).eval()
    with torch.no_grad():  # large random weights (biases and norms included) so every term matters
        for name, param in reference.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=64, block_size=4)
    return runner, reference


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path, hf_smollm2: torch.nn.Module):
    return ModelRunner(smollm2_dir, dtype=torch.float32, device="cpu", num_blocks=64, block_size=16), hf_smollm2


def reference_logits(reference: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([tokens])).logits[0].float()  # [len(tokens), vocab]


def prompt(runner: ModelRunner, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(runner.vocab_size) for _ in range(length)]


def check_prefill_chunks_and_decode(runner: ModelRunner, reference: torch.nn.Module, length: int,
                                    decode_from: int, seed: int) -> None:
    rng = random.Random(seed)
    tokens = prompt(runner, length, seed)
    ref = reference_logits(reference, tokens)
    free = list(range(runner.num_blocks))
    num_blocks = -(-length // runner.block_size)

    whole = runner.execute(ForwardBatch((SeqChunk(tuple(tokens), 0, shuffled_table(rng, free, num_blocks)),)))
    assert whole.shape == (1, runner.vocab_size) and whole.dtype == torch.float32
    assert rel_err(whole[0], ref[-1]) < TOLERANCE

    table = shuffled_table(rng, free, num_blocks)  # three uneven chunks, logits from each chunk's end
    cuts = [0, length // 3 + 1, 2 * length // 3 - 1, length]
    for start, end in itertools.pairwise(cuts):
        out = runner.execute(ForwardBatch((SeqChunk(tuple(tokens[start:end]), start, table),)))
        assert rel_err(out[0], ref[end - 1]) < TOLERANCE, (start, end)

    table = shuffled_table(rng, free, num_blocks)  # prefill a prefix, then every later position one by one
    runner.execute(ForwardBatch((SeqChunk(tuple(tokens[:decode_from]), 0, table, want_logits=False),)))
    for pos in range(decode_from, length):
        out = runner.execute(ForwardBatch((SeqChunk((tokens[pos],), pos, table),)))
        assert rel_err(out[0], ref[pos]) < TOLERANCE, pos


def check_mixed_batch(runner: ModelRunner, reference: torch.nn.Module, lengths: tuple[int, int, int],
                      seed: int) -> None:
    """Seq A prefills its second chunk while B and C decode, all in one step, tables shuffled."""
    rng = random.Random(seed)
    free = list(range(runner.num_blocks))
    seqs = [prompt(runner, n, seed + i) for i, n in enumerate(lengths)]
    refs = [reference_logits(reference, s) for s in seqs]
    tables = [shuffled_table(rng, free, -(-n // runner.block_size)) for n in lengths]
    a, b, c = seqs
    a_cut = len(a) // 2
    runner.execute(ForwardBatch((SeqChunk(tuple(a[:a_cut]), 0, tables[0], want_logits=False),
                                 SeqChunk(tuple(b[:-1]), 0, tables[1], want_logits=False),
                                 SeqChunk(tuple(c[:-1]), 0, tables[2], want_logits=False))))
    out = runner.execute(ForwardBatch((SeqChunk((b[-1],), len(b) - 1, tables[1]),
                                       SeqChunk(tuple(a[a_cut:]), a_cut, tables[0]),
                                       SeqChunk((c[-1],), len(c) - 1, tables[2]))))
    assert out.shape == (3, runner.vocab_size)
    for row, (ref, seq) in enumerate(((refs[1], b), (refs[0], a), (refs[2], c))):
        assert rel_err(out[row], ref[len(seq) - 1]) < TOLERANCE, row


def test_tiny_prefill_chunks_decode(tiny) -> None:
    runner, reference = tiny
    check_prefill_chunks_and_decode(runner, reference, length=23, decode_from=1, seed=1)


def test_tiny_mixed_batch(tiny) -> None:
    runner, reference = tiny
    check_mixed_batch(runner, reference, lengths=(19, 9, 14), seed=2)


def test_smollm2_prefill_chunks_decode(smollm2) -> None:
    runner, reference = smollm2
    check_prefill_chunks_and_decode(runner, reference, length=45, decode_from=30, seed=3)


def test_smollm2_mixed_batch(smollm2) -> None:
    runner, reference = smollm2
    check_mixed_batch(runner, reference, lengths=(34, 17, 25), seed=4)


def test_copied_block_serves_a_shared_prefix(smollm2) -> None:
    """copy_blocks (copy-on-write of a partial block) gives a second sequence the same KV as the first."""
    runner, reference = smollm2
    tokens = prompt(runner, 24, seed=5)
    ref = reference_logits(reference, tokens)
    runner.execute(ForwardBatch((SeqChunk(tuple(tokens[:20]), 0, (7, 3), want_logits=False),)))
    runner.kv_cache.copy_blocks([3], [11])  # block 7 (full) is shared, block 3 (partial) copied
    k, v = runner.kv_cache.read_blocks(5, [3])
    assert torch.equal(k, runner.kv_cache.read_blocks(5, [11])[0])   # exact: copy_blocks copies bytes
    out = runner.execute(ForwardBatch((SeqChunk(tuple(tokens[20:]), 20, (7, 11)),)))
    assert rel_err(out[0], ref[-1]) < TOLERANCE
    runner.kv_cache.write_blocks(5, [12], k, v)
    assert torch.equal(runner.kv_cache.read_blocks(5, [12])[1], v)   # exact: write/read_blocks copy bytes


@pytest.mark.parametrize("chunk, message", [
    (SeqChunk((), 0, (0,)), "no tokens"),
    (SeqChunk((1, 2), 0, ()), "blocks cannot hold"),
    (SeqChunk((1,) * 17, 0, (0,)), "blocks cannot hold"),
    (SeqChunk((1,), 0, (64,)), "block id out of range"),
    (SeqChunk((1,), 0, (-1,)), "block id out of range"),
    (SeqChunk((49152,), 0, (0,)), "token id out of range"),
    (SeqChunk((1,), -1, (0,)), "negative context"),
    (SeqChunk((1,), 8192, tuple(range(64))), "past max_model_len"),
])
def test_bad_batches_are_rejected(smollm2, chunk: SeqChunk, message: str) -> None:
    runner, _ = smollm2
    with pytest.raises(ValueError, match=message):
        runner.execute(ForwardBatch((chunk,)))


def test_empty_batch_and_no_logits(smollm2) -> None:
    runner, _ = smollm2
    assert runner.execute(ForwardBatch(())).shape == (0, runner.vocab_size)
    out = runner.execute(ForwardBatch((SeqChunk((1, 2, 3), 0, (0,), want_logits=False),)))
    assert out.shape == (0, runner.vocab_size)


def test_smollm2_logits_do_not_depend_on_the_batch(smollm2, hf_smollm2_f64: torch.nn.Module) -> None:
    """On CPU in float32 a sequence's logits alone, beside decodes that pad to the same number of blocks,
    and beside a prefill chunk agree within float32 rounding, not bit for bit: no kernel guarantees
    that. oneDNN's packed matmuls gave a row the same bits whatever the row count on the AVX2 EPYC,
    but on an EPYC with AVX-512 (BF16/VNNI) this comparison differed 3 runs in 3; oneDNN picks its
    blocking by ISA and shape, and SDPA's reductions run over the padded key count.
    The bound is measured, not guessed: transformers' float32 logits on the same tokens deviate from
    its float64 ones by at most s; each float32 evaluation, however blocked, lies within a few s of
    the exact logits, so two lie within TOLERANCE_MULTIPLE * s = 8 s of each other (see
    tests/backends/numerics.py). A row that read another row's KV, or a padded key, moves by 0.1 or
    more: over a thousand times the bound."""
    runner, reference = smollm2
    rng = random.Random(5)
    free = list(range(runner.num_blocks))
    seqs = [prompt(runner, n, 50 + i) for i, n in enumerate((21, 30, 12, 40))]
    tables = [shuffled_table(rng, free, -(-n // runner.block_size)) for n in (21, 30, 12, 40)]
    runner.execute(ForwardBatch(tuple(SeqChunk(tuple(s[:-1]), 0, t, want_logits=False)
                                      for s, t in zip(seqs[:3], tables[:3], strict=True))))
    steps = [SeqChunk((s[-1],), len(s) - 1, t) for s, t in zip(seqs[:3], tables[:3], strict=True)]
    alone = runner.execute(ForwardBatch((steps[0],)))   # rewriting the same slot with the same K/V each time
    beside_decodes = runner.execute(ForwardBatch((steps[1], steps[0], steps[2])))
    beside_prefill = runner.execute(ForwardBatch((SeqChunk(tuple(seqs[3]), 0, tables[3]), steps[0])))
    tolerance = logit_tolerance(reference, hf_smollm2_f64, [seqs[0]])
    assert (alone[0] - beside_decodes[1]).abs().max().item() <= tolerance
    assert (alone[0] - beside_prefill[1]).abs().max().item() <= tolerance
    assert rel_err(alone[0], reference_logits(reference, seqs[0])[-1]) < TOLERANCE   # and they are this sequence's


def test_smollm2_decodes_of_very_different_lengths(smollm2) -> None:
    """A 600-token decode beside short ones (attended in separate length groups): each row matches the
    sequence's logits alone and transformers' reference."""
    runner, reference = smollm2
    rng = random.Random(6)
    free = list(range(runner.num_blocks))
    lengths = (9, 600, 14, 20)
    seqs = [prompt(runner, n, 60 + i) for i, n in enumerate(lengths)]
    tables = [shuffled_table(rng, free, -(-n // runner.block_size)) for n in lengths]
    for s, t in zip(seqs, tables, strict=True):
        runner.execute(ForwardBatch((SeqChunk(tuple(s[:-1]), 0, t, want_logits=False),)))
    steps = [SeqChunk((s[-1],), len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)]
    together = runner.execute(ForwardBatch(tuple(steps)))
    for row, (step, seq) in enumerate(zip(steps, seqs, strict=True)):
        assert rel_err(together[row], runner.execute(ForwardBatch((step,)))[0]) < TOLERANCE, row
        assert rel_err(together[row], reference_logits(reference, seq)[-1]) < TOLERANCE, row
