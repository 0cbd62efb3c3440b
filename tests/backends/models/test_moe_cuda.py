"""The MoE families on CUDA (`gpu`): Mixtral through the Triton expert kernels and DeepSeek-V3 through them and the
latent decode kernel, eagerly and replayed from CUDA graphs, against transformers' own forward (on the CPU) on the
same tiny random weights (tests/backends/models/moe_checkpoints.py). The kernels' own checks are in
tests/backends/triton_checks.py."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from backends.attention.base import AttentionBackendName
from backends.core.batch import ForwardBatch, SeqChunk
from backends.worker.model_runner import ModelRunner
from tests.backends.models.moe_checkpoints import tiny_deepseek_v3, tiny_moe

pytestmark = pytest.mark.gpu


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("family", ["mixtral", "deepseek-v3"])
def test_moe_on_cuda_matches_transformers(family: str, tmp_path: Path) -> None:
    hf = tiny_deepseek_v3(tmp_path, 48) if family == "deepseek-v3" else tiny_moe(family, tmp_path)
    runner = ModelRunner(tmp_path, dtype=torch.float32, device="cuda", num_blocks=64, block_size=4,
                         cuda_graph_max_batch=4)
    assert runner.kernels.name == "triton" and runner.attention.name is AttentionBackendName.TRITON
    assert runner.decode_graphs is not None
    graphs = runner.decode_graphs
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 97) for _ in range(30)] for _ in range(2)]
    tables = [(9, 4, 1, 30, 2, 17, 18, 19), (5, 6, 7, 8, 10, 11, 12, 13)]
    with torch.inference_mode():
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    prefill = 20
    out = runner.execute(ForwardBatch(tuple(SeqChunk(tuple(p[:prefill]), 0, t, num_logits=1)
                                            for p, t in zip(prompts, tables, strict=True)))).cpu()
    for row in range(2):
        assert _rel_err(out[row], refs[row][prefill - 1]) < 1e-3
    for mode in ("replayed", "eager"):
        runner.decode_graphs = graphs if mode == "replayed" else None
        for pos in range(prefill, len(prompts[0])):   # the second pass rewrites the same slots
            batch = ForwardBatch(tuple(SeqChunk((p[pos],), pos, t) for p, t in zip(prompts, tables, strict=True)))
            out = runner.execute(batch).cpu()
            for row in range(2):
                assert _rel_err(out[row], refs[row][pos]) < 1e-3, (mode, pos, row)
