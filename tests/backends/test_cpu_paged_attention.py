"""The CPU paged-decode kernel against the gather + SDPA path it replaces, and the SDPA backend with and without it.

The kernel is built once per machine into $SWITCHYARD_CACHE (about 10 s on 2 cores) and loaded from there after.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from backends import cpu_kernels
from backends.attention import cpu_paged, sdpa
from backends.attention.base import AttentionShape, StepLayout, create_backend, decode_rows
from backends.attention.cpu_paged import load_paged_decode
from backends.attention.sdpa import SDPABackend, attend_group, padded_group
from tests.backends.test_attention_gpu import STEPS, random_step

CPU = torch.device("cpu")
# (num_heads, num_kv_heads, head_dim): SmolLM2's GQA, plain multi-head, wide heads, a head_dim the kernel
# does not specialise (runtime loop), a group of 8.
HEADS = [(9, 3, 64), (4, 4, 64), (16, 4, 128), (6, 2, 80), (8, 1, 32)]
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.fixture(scope="module")
def kernel() -> cpu_paged.PagedDecode:
    """The built kernel: `make test` installs a C++ compiler, so here it must build."""
    loaded = load_paged_decode()
    assert loaded is not None, "the CPU paged decode kernel did not build (see the warning logged)"
    return loaded


def decode_step(shape: AttentionShape, context_lens: list[int], seed: int) -> tuple[StepLayout, torch.Tensor,
                                                                                   torch.Tensor, torch.Tensor]:
    """One decode token per sequence over random caches, each sequence's blocks shuffled across the cache;
    q a strided view of a fused qkv row, as the model passes it."""
    gen = torch.Generator().manual_seed(seed)
    bs = shape.block_size
    needed = [-(-(c + 1) // bs) for c in context_lens]
    blocks = list(range(sum(needed) + 5))
    random.Random(seed).shuffle(blocks)
    tables = [tuple(blocks[sum(needed[:i]):sum(needed[:i + 1])]) for i in range(len(needed))]
    cache_shape = (len(blocks), bs, shape.num_kv_heads, shape.head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen).to(shape.dtype) for _ in range(2))
    n = len(context_lens)
    qkv = torch.randn(n, shape.num_heads + 2 * shape.num_kv_heads, shape.head_dim, generator=gen).to(shape.dtype)
    layout = StepLayout(query_lens=(1,) * n, context_lens=tuple(context_lens), block_tables=tuple(tables),
                        slot_mapping=torch.zeros(n, dtype=torch.long), device=CPU)
    return layout, qkv[:, :shape.num_heads], k_cache, v_cache


# Keys attended = context + 1: one key, a block exactly full (16), one past it (17), two blocks, longer; the kernel
# takes its softmax over spans of 256 keys, so 255, 256 and 257 keys and three spans (700) are among them.
CONTEXTS = {1: [15], 33: [0, 15, 16, 31, 32, 100, 254, 255, 256, 383, 699, *range(200, 222)]}


@pytest.mark.parametrize("n", sorted(CONTEXTS))
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_matches_gather_and_sdpa(kernel, n: int, heads: tuple[int, int, int], dtype: torch.dtype,
                                        index_dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_dim = heads
    shape = AttentionShape(num_heads, num_kv_heads, head_dim, block_size=16, scale=head_dim ** -0.5, dtype=dtype)
    layout, q, k_cache, v_cache = decode_step(shape, CONTEXTS[n], seed=n + num_heads)
    expected = attend_group(shape, q, k_cache, v_cache, padded_group(shape, layout, range(n), range(n)),
                            gather_queries=False)
    rows = decode_rows(layout, range(n), range(n), shape.block_size)
    out = kernel(q, k_cache, v_cache, rows.block_tables.to(index_dtype), rows.seq_lens.to(index_dtype), None,
                 shape.scale)
    assert out.dtype == dtype and out.shape == (n, num_heads, head_dim)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


def run_sdpa(shape: AttentionShape, inputs, paged: bool) -> torch.Tensor:
    """The SDPA backend's forward on `inputs` (from random_step), with the paged kernel or with its loader
    finding none (the fallback)."""
    layout, q, k, v, caches = inputs
    with pytest.MonkeyPatch.context() as patch:
        if not paged:
            patch.setattr(sdpa, "load_paged_decode", lambda: None)
        backend = SDPABackend(shape)
        metadata = backend.prepare(layout)
        assert (metadata.paged is not None) == (paged and min(layout.query_lens) <= cpu_paged.max_chunk(shape))
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        return backend.forward(q, k, v, k_cache, v_cache, layout.slot_mapping, metadata)


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_backend_with_the_kernel_matches_without(kernel, step: str, dtype: torch.dtype) -> None:
    """Decode-only, mixed (decodes between prefills: rows gathered and scattered back) and prefill-only steps."""
    shape = AttentionShape(9, 3, 64, block_size=16, scale=64 ** -0.5, dtype=dtype)
    inputs = random_step(shape, *STEPS[step], seed=len(step), device=CPU)
    with_kernel = run_sdpa(shape, inputs, paged=True)
    without = run_sdpa(shape, inputs, paged=False)
    torch.testing.assert_close(with_kernel.float(), without.float(), **TOLERANCE[dtype])


# Short chunks (speculative tokens to verify, a short prompt) beside decodes and a prefill the kernel leaves to
# SDPA: each chunk's tokens see the context and the chunk's earlier tokens only.
SHORT_CHUNKS = {
    "verify": ([6, 6, 6, 6], [300, 17, 0, 95]),                # all rows to the kernel, in order
    "mixed": ([1, 6, 40, 2, 16, 1], [255, 31, 0, 15, 100, 0]),  # a 40-token prefill among them: gather, scatter
    "long chunks": ([16, 9, 1], [3, 511, 40]),
}


@pytest.mark.parametrize("step", sorted(SHORT_CHUNKS))
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 64), (16, 4, 128), (6, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_chunks_match_sdpa(kernel, step: str, heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_dim = heads
    shape = AttentionShape(num_heads, num_kv_heads, head_dim, block_size=16, scale=head_dim ** -0.5, dtype=dtype)
    # (16, 4, 128) takes chunks of up to 8 tokens: its 9- and 16-token chunks stay with SDPA beside the kernel's.
    assert min(SHORT_CHUNKS[step][0]) <= cpu_paged.max_chunk(shape)   # the kernel has rows in every case
    inputs = random_step(shape, *SHORT_CHUNKS[step], seed=len(step) + num_heads, device=CPU)
    with_kernel = run_sdpa(shape, inputs, paged=True)
    without = run_sdpa(shape, inputs, paged=False)
    torch.testing.assert_close(with_kernel.float(), without.float(), **TOLERANCE[dtype])


def test_the_kernel_refuses_what_its_buffers_cannot_hold(kernel) -> None:
    """A chunk with more query rows per KV head than the kernel holds is an error, not a stack overflow."""
    shape = AttentionShape(16, 1, 64, block_size=16, scale=0.125, dtype=torch.float32)
    assert cpu_paged.max_chunk(shape) == 4   # 16 query heads per KV head: 64 rows at most
    inputs = random_step(shape, [5], [20], seed=0, device=CPU)
    layout, q, _, _, (k_cache, v_cache) = inputs
    rows = decode_rows(layout, [0], [0], shape.block_size)
    with pytest.raises(RuntimeError, match="too many query rows"):
        kernel(q, k_cache, v_cache, rows.block_tables, rows.seq_lens, rows.query_starts, shape.scale)


def test_unsupported_shape_keeps_the_gather_path(kernel) -> None:
    shape = AttentionShape(9, 3, 64, block_size=16, scale=0.125, dtype=torch.float16)
    layout, *_ = random_step(shape, *STEPS["decode"], seed=0, device=CPU)
    assert SDPABackend(shape).prepare(layout).paged is None


def test_switched_off_by_the_environment(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_paged.ENV_SWITCH, "0")
    load_paged_decode.cache_clear()
    try:
        assert load_paged_decode() is None
    finally:
        load_paged_decode.cache_clear()   # the next caller loads the built kernel again


def test_a_failed_build_logs_and_falls_back(kernel, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler() -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_kernels, "_build", no_compiler)
    cpu_kernels.load.cache_clear()
    load_paged_decode.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert load_paged_decode() is None
            load_paged_decode.cache_clear()
            assert load_paged_decode() is None
        assert len([r for r in caplog.records if "unavailable" in r.message]) == 1   # logged once
    finally:
        cpu_kernels.load.cache_clear()
        load_paged_decode.cache_clear()   # the next caller loads the built kernel again


def test_a_cpu_backend_loads_the_kernel_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's backend loads (or builds) the kernel at start, not in its first decode step."""
    calls: list[int] = []

    def loader() -> None:
        calls.append(1)

    monkeypatch.setattr(sdpa, "load_paged_decode", loader)
    shape = AttentionShape(9, 3, 64, block_size=16, scale=0.125, dtype=torch.float32)
    create_backend("sdpa", shape, CPU)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_cpu_backend_decodes_with_the_kernel(kernel, dtype: torch.dtype) -> None:
    """The runner's default on the CPU, so the model tests against transformers (test_model_forward.py,
    engine/test_engine_model.py) run their decodes through the kernel."""
    shape = AttentionShape(9, 3, 64, block_size=16, scale=0.125, dtype=dtype)
    layout, *_ = random_step(shape, *STEPS["mixed"], seed=0, device=CPU)
    metadata = create_backend(None, shape, CPU).prepare(layout)
    assert metadata.paged is not None and metadata.paged.kernel is kernel


def test_each_checkout_builds_in_a_folder_of_its_own(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sources in another folder (another checkout) get another build folder: ninja's build file names
    the sources by absolute path, so sharing one would rebuild and replace the library at every switch."""
    here = cpu_kernels.build_dir()
    copy = tmp_path / "cpu_kernels"
    copy.mkdir()
    for path in (*cpu_kernels._SOURCES, *cpu_kernels._HEADERS):
        (copy / path.name).write_text(path.read_text())
    monkeypatch.setattr(cpu_kernels, "_FOLDER", copy)
    monkeypatch.setattr(cpu_kernels, "_SOURCES", tuple(copy / p.name for p in cpu_kernels._SOURCES))
    monkeypatch.setattr(cpu_kernels, "_HEADERS", tuple(copy / p.name for p in cpu_kernels._HEADERS))
    assert cpu_kernels.build_dir() != here
    assert cpu_kernels.build_dir() == cpu_kernels.build_dir()   # and stays put for one checkout
