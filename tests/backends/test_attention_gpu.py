"""The CUDA attention backends (Triton paged decode, flash_attn) against the SDPA reference on random paged data."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from backends.attention.base import AttentionShape, StepLayout, create_backend

pytestmark = pytest.mark.gpu

NUM_BLOCKS = 128


CUDA = torch.device("cuda")


def random_step(shape: AttentionShape, query_lens: list[int], context_lens: list[int], seed: int,
                device: torch.device = CUDA):
    """Random q/k/v, a random cache and shuffled block tables on `device`, as one step's inputs."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rng = random.Random(seed)
    bs, dev = shape.block_size, device
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables, slots = [], []
    for q_len, ctx in zip(query_lens, context_lens, strict=True):
        table = tuple(free.pop() for _ in range(-(-(ctx + q_len) // bs)))
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q_len)]
    num_tokens = sum(query_lens)
    cache_shape = (NUM_BLOCKS, bs, shape.num_kv_heads, shape.head_dim)
    rand = lambda *s: torch.randn(*s, generator=gen).to(dev, shape.dtype)  # noqa: E731
    caches = rand(*cache_shape), rand(*cache_shape)
    q = rand(num_tokens, shape.num_heads, shape.head_dim)
    k, v = rand(num_tokens, shape.num_kv_heads, shape.head_dim), rand(num_tokens, shape.num_kv_heads, shape.head_dim)
    layout = StepLayout(query_lens=tuple(query_lens), context_lens=tuple(context_lens), block_tables=tuple(tables),
                        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), device=dev)
    return layout, q, k, v, caches


def run_backend(name: str, shape: AttentionShape, layout: StepLayout, q, k, v, caches) -> torch.Tensor:
    backend = create_backend(name, shape, layout.device)
    k_cache, v_cache = caches[0].clone(), caches[1].clone()
    return backend.forward(q, k, v, k_cache, v_cache, layout.slot_mapping, backend.prepare(layout))


STEPS = {
    "decode": ([1] * 9, [0, 5, 16, 17, 31, 100, 255, 256, 300]),
    "mixed": ([1, 37, 1, 5, 1], [40, 0, 7, 64, 200]),
    "prefill": ([64, 3], [0, 29]),
}


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("heads", [(8, 8, 64), (9, 3, 64), (32, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_matches_sdpa(step: str, heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_dim = heads
    shape = AttentionShape(num_heads, num_kv_heads, head_dim, block_size=16, scale=head_dim ** -0.5, dtype=dtype)
    inputs = random_step(shape, *STEPS[step], seed=len(step) + num_heads)
    ours = run_backend("triton", shape, *inputs)
    ref = run_backend("sdpa", shape, *inputs)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_matches_sdpa(step: str, block_size: int) -> None:
    pytest.importorskip("flash_attn")
    shape = AttentionShape(9, 3, 64, block_size=block_size, scale=0.125, dtype=torch.bfloat16)
    inputs = random_step(shape, *STEPS[step], seed=7)
    ours = run_backend("flash", shape, *inputs)
    ref = run_backend("sdpa", shape, *inputs)
    torch.testing.assert_close(ours.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_runner_on_cuda_matches_transformers(smollm2_dir: Path, hf_smollm2: torch.nn.Module) -> None:
    from backends.core.batch import ForwardBatch, SeqChunk
    from backends.worker.model_runner import ModelRunner

    runner = ModelRunner(smollm2_dir, dtype=torch.float32, device="cuda", num_blocks=64, attention_backend="triton")
    tokens = list(range(200, 260))
    with torch.inference_mode():
        ref = hf_smollm2(torch.tensor([tokens])).logits[0]
    runner.execute(ForwardBatch((SeqChunk(tuple(tokens[:40]), 0, (9, 4, 1, 30), want_logits=False),)))
    for pos in range(40, len(tokens)):
        out = runner.execute(ForwardBatch((SeqChunk((tokens[pos],), pos, (9, 4, 1, 30)),))).cpu()
        assert ((out[0] - ref[pos]).abs().max() / ref[pos].abs().max()).item() < 1e-3, pos
