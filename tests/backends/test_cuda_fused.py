"""The CUDA decoder's own Triton kernels on a GPU (`gpu`): the split paged-decode attention and the fused
rotary/cache-write and SiLU kernels against their references (tests/backends/triton_checks.py, which `make test`
also runs under Triton's interpreter), and a whole model through them, eagerly and replayed from CUDA graphs,
against transformers' own forward. The model is a small Llama of random weights (no model file needed)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.core.batch import ForwardBatch, SeqChunk
from tests.backends import triton_checks
from tests.backends.engine.test_kv_tiers_devices import hf_tiny, prompt, tiny_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu


def test_split_paged_decode_matches_sdpa_on_cuda() -> None:
    triton_checks.decode_splits(torch.device("cuda"))


def test_fused_layer_kernels_match_float64_on_cuda() -> None:
    triton_checks.fused_layers(torch.device("cuda"))


def test_one_row_projection_matches_float64_on_cuda() -> None:
    triton_checks.gemv(torch.device("cuda"))


def test_grouped_expert_kernels_match_torch_on_cuda() -> None:
    triton_checks.moe_experts(torch.device("cuda"))


def test_latent_decode_kernel_matches_sdpa_on_cuda() -> None:
    triton_checks.latent_decode(torch.device("cuda"))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("kernels", ["triton", "triton, gemv forced", "torch"])
def test_tiny_llama_on_cuda_matches_transformers(tiny_dir: Path, hf_tiny: torch.nn.Module,  # noqa: F811
                                                 kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences, then one alone (a one-row step: the projections' gemv where it was picked)."""
    from backends.models.kernels import triton_ops
    from backends.models.layers import Linear
    from backends.worker.model_runner import ModelRunner

    monkeypatch.setattr(triton_ops, "ENABLED", kernels != "torch")   # before the graphs are captured
    if kernels == "triton, gemv forced":
        monkeypatch.setattr(triton_ops, "pick_gemv", lambda weight: triton_ops.GEMV_CONFIGS[1])
    runner = ModelRunner(tiny_dir, dtype=torch.float32, device="cuda", num_blocks=64, attention_backend="triton",
                         cuda_graph_max_batch=8)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    if kernels == "triton, gemv forced":   # in float32 the widening projections are stored [in, out]: cuBLAS's
        assert any(m.gemv_eligible() for m in linears)
        unforced = [(name, tuple(m.weight.shape), m.gemv_config) for name, m in runner.model.named_modules()
                    if isinstance(m, Linear) and m.gemv_eligible() and m.gemv_config != triton_ops.GEMV_CONFIGS[1]]
        assert not unforced, (type(runner.kernels).__name__, unforced)
    elif kernels == "torch":
        assert all(m.gemv_config is None for m in linears)
    assert runner.decode_graphs is not None
    graphs = runner.decode_graphs
    prompts = [prompt(10 + i, 50 + 7 * i) for i in range(3)]
    tables = [(9, 4, 1, 30, 2), (5, 6, 7, 8, 10), (11, 12, 13, 14, 15)]
    with torch.inference_mode():
        refs = [hf_tiny(torch.tensor([p])).logits[0] for p in prompts]
    prefill, batch_end = 40, 50
    out = runner.execute(ForwardBatch(tuple(SeqChunk(tuple(p[:prefill]), 0, t, num_logits=1)
                                            for p, t in zip(prompts, tables, strict=True))))
    for row in range(3):   # a prefill step: SDPA over the cache the fused kernel wrote
        assert _rel_err(out[row].cpu(), refs[row][prefill - 1]) < 1e-3
    for mode in ("replayed", "eager"):
        runner.decode_graphs = graphs if mode == "replayed" else None
        for pos in range(prefill, batch_end):   # rewrites the same K/V at the same slots in the second pass
            batch = ForwardBatch(tuple(SeqChunk((p[pos],), pos, t) for p, t in zip(prompts, tables, strict=True)))
            assert (graphs.covers(batch) and mode == "replayed") or runner.decode_graphs is None
            out = runner.execute(batch).cpu()
            for row in range(3):
                assert _rel_err(out[row], refs[row][pos]) < 1e-3, (mode, pos, row)
    longer = prompts[2] + prompt(99, 10)
    with torch.inference_mode():
        ref = hf_tiny(torch.tensor([longer])).logits[0]
    for mode in ("replayed", "eager"):
        runner.decode_graphs = graphs if mode == "replayed" else None
        for pos in range(batch_end, len(longer)):   # the third sequence on from where the batch left it
            out = runner.execute(ForwardBatch((SeqChunk((longer[pos],), pos, tables[2]),))).cpu()
            assert _rel_err(out[0], ref[pos]) < 1e-3, (mode, pos)
