"""Decode steps replayed from CUDA graphs (backends/worker/cuda_graphs.py).

On any machine: the buckets and the padded inputs a replay reads. With CUDA (`gpu`): replayed logits
equal eager ones for batches that fill a bucket and batches padded up to one, both agree with
transformers' own forward, and an engine decoding through graphs gives transformers' greedy tokens.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.core.batch import ForwardBatch, SeqChunk
from backends.core.sampling_params import SamplingParams
from backends.worker.cuda_graphs import graph_buckets, is_plain_decode, pack_decode_inputs
from tests.backends.numerics import (
    assert_mostly_clear,
    assert_same_tokens,
    choices,
    logit_tolerance,
    teacher_forced_logits,
)


def test_buckets_cover_every_batch_size_up_to_the_largest() -> None:
    assert graph_buckets(1) == (1,)
    assert graph_buckets(6) == (1, 2, 4, 6)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    for n in range(1, 65):
        assert any(b >= n for b in graph_buckets(64))
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_only_plain_decode_steps_are_replayed() -> None:
    decode = SeqChunk((5,), 3, (0,))
    assert is_plain_decode(ForwardBatch((decode, decode)))
    assert not is_plain_decode(ForwardBatch((decode, SeqChunk((5, 6), 3, (0,)))))            # a prefill chunk
    assert not is_plain_decode(ForwardBatch((SeqChunk((5,), 3, (0,), want_logits=False),)))
    assert not is_plain_decode(ForwardBatch((SeqChunk((5, 7), 3, (0,), num_logits=2),)))     # drafts to verify


def test_inputs_are_packed_and_padded_with_the_first_row() -> None:
    batch = ForwardBatch((SeqChunk((11,), 0, (7,)), SeqChunk((12,), 20, (3, 9, 4)), SeqChunk((13,), 16, (5, 6))))
    table, tables = pack_decode_inputs(batch, bucket=4, block_size=16)
    assert table.tolist() == [[11, 12, 13, 11],        # token ids
                              [0, 20, 16, 0],          # positions
                              [7 * 16, 9 * 16 + 4, 6 * 16, 7 * 16],   # slots: block_table[pos // 16] * 16 + pos % 16
                              [1, 21, 17, 1]]          # lengths, the new token counted
    assert tables.dtype == torch.int32
    assert tables.tolist() == [[7, 0], [3, 9], [5, 6], [7, 0]]   # as wide as the longest needs (2 blocks)
    with pytest.raises(ValueError):
        pack_decode_inputs(batch, bucket=2, block_size=16)


# --- on CUDA --------------------------------------------------------------------------------------

def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.gpu
def test_replayed_decode_equals_eager_and_transformers(smollm2_dir: Path, hf_smollm2: torch.nn.Module) -> None:
    from backends.worker.model_runner import ModelRunner

    runner = ModelRunner(smollm2_dir, dtype=torch.float32, device="cuda", num_blocks=128,
                         attention_backend="triton", cuda_graph_max_batch=8)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.buckets == (1, 2, 4, 8)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (5, 40, 17, 33, 64, 2, 29)]
    tables = [tuple(range(16 * i, 16 * i + 8)) for i in range(len(prompts))]   # 128 tokens each
    for prompt, table in zip(prompts, tables, strict=True):
        runner.execute(ForwardBatch((SeqChunk(tuple(prompt[:-1]), 0, table),)))
    with torch.inference_mode():
        want = [hf_smollm2(torch.tensor([p])).logits[0, -1] for p in prompts]
    for n in (1, 3, 4, 7):   # a full bucket, and batches padded up to one
        batch = ForwardBatch(tuple(SeqChunk((p[-1],), len(p) - 1, t)
                                   for p, t in zip(prompts[:n], tables[:n], strict=True)))
        assert graphs.covers(batch)
        replayed = runner.execute(batch)
        runner.decode_graphs = None           # the same step, eagerly
        eager = runner.execute(batch)
        runner.decode_graphs = graphs
        assert replayed.shape == eager.shape == (n, runner.vocab_size)
        assert _relative_gap(replayed, eager) < 1e-5, n
        for row in range(n):
            assert _relative_gap(replayed[row].cpu(), want[row]) < 1e-3, (n, row)


@pytest.mark.gpu
def test_engine_decoding_through_graphs_gives_transformers_greedy_tokens(
        smollm2_dir: Path, hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module) -> None:
    from backends.core.engine_config import EngineConfig
    from backends.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(device="cuda", dtype="float32", num_blocks=256, max_num_seqs=8,
                                    attention_backend="triton"), model_dir=smollm2_dir)
    assert engine.runner.decode_graphs is not None
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (12, 30, 7, 21, 50)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].extend(out.new_token_ids)
    # transformers' greedy answers, and where float32 rounding could have gone either way
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [p + got[str(i)] for i, p in enumerate(prompts)])
    references = []
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            want = hf_smollm2.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                                       pad_token_id=0)[0, len(prompt):].tolist()
        reference = choices(teacher_forced_logits(hf_smollm2, prompt, want), params, None, engine.eos_token_ids,
                            tolerance, prompt)
        references.append(reference)
        assert_same_tokens(got[str(i)], want, reference, f"prompt {i} through CUDA graphs")
    assert_mostly_clear(references, "transformers' greedy tokens")
