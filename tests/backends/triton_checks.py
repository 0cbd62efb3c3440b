"""Checks of the Triton kernels that run on any device Triton runs on: on CPU tensors under Triton's
interpreter (tests/backends/triton_interpreted.py, in `make test`) and on CUDA (tests/backends/test_cuda_fused.py,
`gpu`-marked). Each prints one line per check and raises on the first mismatch."""
from __future__ import annotations

import torch


def decode_splits(device: torch.device) -> None:
    """The paged-decode kernel split across programs (flash-decoding) at every split count a step can get,
    empty splits included (a 1-token sequence over 16 splits), against SDPA; and the default choice."""
    from backends.attention.base import AttentionShape, decode_rows
    from backends.attention.sdpa import SDPABackend
    from backends.attention.triton_decode import MAX_SPLITS, decode_splits, paged_decode
    from tests.backends.test_attention_gpu import STEPS, random_step

    assert decode_splits(1, 2, device) > 1 and decode_splits(512, 8, device) == 1
    assert all(1 <= decode_splits(n, h, device) <= MAX_SPLITS for n in range(1, 70) for h in (1, 3, 8))
    for heads, dtype in (((9, 3, 64), torch.float32), ((8, 2, 128), torch.bfloat16), ((6, 6, 40), torch.float32)):
        shape = AttentionShape(*heads, block_size=16, scale=heads[2] ** -0.5, dtype=dtype)
        layout, q, k, v, caches = random_step(shape, *STEPS["decode"], seed=heads[1], device=device)
        sdpa = SDPABackend(shape)
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        want = sdpa.forward(q, k, v, k_cache, v_cache, layout.slot_mapping, sdpa.prepare(layout)).float()
        rows = decode_rows(layout, range(len(layout.query_lens)), layout.starts, shape.block_size)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        for splits in (1, 2, 3, MAX_SPLITS):
            got = paged_decode(q, k_cache, v_cache, rows.block_tables, rows.seq_lens, shape.scale,
                               splits=splits).float()
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            print(f"decode heads={heads} {dtype} splits={splits}: triton == sdpa")


def fused_layers(device: torch.device) -> None:
    """backends/models/kernels/triton_ops.py: rotary + cache writes + q in one kernel, against the torch ops it
    replaces in float64 (the caches' other slots untouched); SiLU * up and the residual add + RMSNorm against
    float64."""
    from backends.attention.base import write_kv
    from backends.models.kernels.base import apply_rotary
    from backends.models.kernels.triton_ops import add_rms_norm, rotary_store, silu_mul

    gen = torch.Generator().manual_seed(3)
    for heads, kv_heads, head_dim, dtype in ((9, 3, 64, torch.float32), (4, 2, 128, torch.bfloat16),
                                             (6, 6, 40, torch.float32)):
        tokens, num_blocks, block_size = 7, 6, 4
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
        positions = torch.tensor([0, 1, 5, 17, 300, 2, 9])
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
        freqs = positions.double()[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        cos_full, sin_signed = (torch.cat(t, -1).to(device, dtype) for t in ((cos, cos), (-sin, sin)))
        slots = torch.tensor([3, 0, 22, 9, 14, 5, 17], device=device)
        caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
                  for _ in range(2)]
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        q = rotary_store(qkv, cos_full, sin_signed, heads, kv_heads, k_cache, v_cache, slots)
        cos, sin = cos.to(device), sin.to(device)
        x = qkv.double().view(tokens, heads + 2 * kv_heads, head_dim)
        qk = apply_rotary(x[:, :heads + kv_heads], cos, sin)
        want_k, want_v = caches[0].double(), caches[1].double()
        write_kv(qk[:, heads:], x[:, heads + kv_heads:], want_k, want_v, slots)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(q.double(), qk[:, :heads], atol=tol, rtol=tol)
        torch.testing.assert_close(k_cache.double(), want_k, atol=tol, rtol=tol)
        torch.testing.assert_close(v_cache.double(), want_v, atol=0, rtol=0)   # a copy of v's bits
        print(f"rotary_store heads={heads}/{kv_heads}x{head_dim} {dtype}: == rotary and cache writes in float64")
        gate_up = torch.randn(5, 2 * 1500, generator=gen).to(device, dtype) * 3
        g, u = gate_up.double()[:, :1500], gate_up.double()[:, 1500:]
        torch.testing.assert_close(silu_mul(gate_up).double(), g * torch.sigmoid(g) * u, atol=tol, rtol=tol)
        print(f"silu_mul {dtype}: == float64")
        for width in (576, 1000):
            x = torch.randn(6, width, generator=gen).to(device, dtype) * 2
            residual = torch.randn(6, width, generator=gen).to(device, dtype)
            weight = (torch.rand(width, generator=gen) + 0.5).to(device, dtype)
            total = x.double() + residual.double()
            want = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
            x_in = x.clone()
            normed, summed = add_rms_norm(x_in, residual, weight, 1e-5)
            assert summed.data_ptr() == x_in.data_ptr()   # the sum is written over x, as documented
            torch.testing.assert_close(summed.double(), total, atol=tol, rtol=tol)
            torch.testing.assert_close(normed.double(), want, atol=tol * 4, rtol=tol * 4)
            alone, same = add_rms_norm(x, None, weight, 1e-5)
            want_alone = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
            assert same is x
            torch.testing.assert_close(alone.double(), want_alone, atol=tol * 4, rtol=tol * 4)
            print(f"add_rms_norm width={width} {dtype}: == float64")


def gemv(device: torch.device) -> None:
    """triton_ops.gemv, every configuration, against float64: row counts and widths that are not multiples of
    its blocks, an [out, in] weight that is a row slice of a wider one (its stride), float32 and bfloat16."""
    from backends.models.kernels.triton_ops import GEMV_CONFIGS, gemv as project

    gen = torch.Generator().manual_seed(4)
    for out_features, in_features, dtype in ((37, 300, torch.float32), (130, 4100, torch.bfloat16)):
        wide = torch.randn(out_features, in_features + 8, generator=gen).to(device, dtype)
        weight = wide[:, 3:3 + in_features]
        x = torch.randn(1, in_features, generator=gen).to(device, dtype)
        want = x.double() @ weight.double().t()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for config in GEMV_CONFIGS:
            got = project(x, weight, config)
            assert got.shape == (1, out_features) and got.dtype == dtype
            torch.testing.assert_close(got.double(), want, atol=tol * 10, rtol=tol)
        print(f"gemv {out_features}x{in_features} {dtype}: {len(GEMV_CONFIGS)} configurations == float64")


def moe_experts(device: torch.device) -> None:
    """backends/models/kernels/triton_moe.py against the torch path (backends.models.moe.grouped_experts): skewed
    routing so that one expert spans several tiles and others get no rows, one token, widths that are not
    multiples of the blocks, both tile heights; then a whole MoEBlock through TritonKernels against the
    reference kernels, which checks that the layer takes the Triton path."""
    from backends.models.kernels import triton_moe
    from backends.models.kernels.base import LayerKernels
    from backends.models.kernels.triton import TritonKernels
    from backends.models.kernels.triton_moe import block_m, grouped_experts as triton_grouped
    from backends.models.moe import QWEN_NAMES, MoEBlock, MoEConfig, grouped_experts, softmax_topk

    gen = torch.Generator().manual_seed(5)
    cases = ((1, 72, 40, 8, 2, torch.float32), (40, 72, 40, 8, 2, torch.float32), (300, 64, 96, 4, 2, torch.bfloat16),
             (5, 128, 64, 16, 4, torch.bfloat16))
    for tokens, hidden, inter, experts, k, dtype in cases:
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        skew = torch.zeros(experts)
        skew[3], skew[-1] = 3.0, -9.0   # expert 3 takes most tokens, the last one none
        logits = torch.randn(tokens, experts, generator=gen) + skew
        weights, ids = softmax_topk(logits.to(device), k, renormalize=True)
        gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
        down = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(device, dtype)
        want = grouped_experts(x, ids, weights, gate_up, down, LayerKernels()).float()
        got = triton_grouped(x, ids, weights, gate_up, down)
        assert got.shape == x.shape and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
        print(f"grouped experts T={tokens} E={experts} k={k} {hidden}x{inter} {dtype} "
              f"(tiles of {block_m(tokens * k, experts)}): triton == torch")
    config = MoEConfig(hidden_size=64, num_experts=8, top_k=2, intermediate_size=48, renormalize=False,
                       names=QWEN_NAMES)
    blocks = [MoEBlock(config, kernels) for kernels in (TritonKernels(), LayerKernels())]
    for name, tensor in blocks[0].named_parameters():
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.2)
        blocks[1].get_parameter(name).copy_(tensor)
    x = torch.randn(9, 64, generator=gen)
    blocks = [block.to(device) for block in blocks]
    calls: list[int] = []
    kernel = triton_moe.grouped_experts
    triton_moe.grouped_experts = lambda *args: calls.append(1) or kernel(*args)   # counts the layer's calls
    try:
        got, want = blocks[0](x.to(device)), blocks[1](x.to(device))
    finally:
        triton_moe.grouped_experts = kernel
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    print("MoEBlock on TritonKernels == MoEBlock on the reference kernels")


def latent_decode(device: torch.device) -> None:
    """backends/attention/triton_mla.py through the Triton backend against SDPA over the same latent cache
    (backends/attention/sdpa.py, checked against transformers through DeepSeek-V3): value channels past the K
    half, within it only, and an odd width; more heads than one program takes; decode and mixed steps; every
    split count on the decode step; and the inputs a CUDA graph replays."""
    from backends.attention.base import AttentionShape, decode_rows
    from backends.attention.sdpa import SDPABackend
    from backends.attention.triton_decode import TritonDecodeBackend
    from backends.attention.triton_mla import latent_decode as decode
    from backends.attention.triton_splits import MAX_SPLITS
    from tests.backends.test_attention_gpu import NUM_BLOCKS, STEPS, random_step

    for heads, half, value_dim, dtype in ((4, 24, 32, torch.float32), (20, 26, 36, torch.bfloat16),
                                          (4, 28, 16, torch.float32)):
        shape = AttentionShape(heads, 1, half, block_size=16, scale=0.1, dtype=dtype, latent_value_dim=value_dim)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        for step in ("decode", "mixed"):
            layout, _, k, v, caches = random_step(shape, *STEPS[step], seed=heads + half, device=device)
            q = torch.randn(layout.num_tokens, heads, 2 * half, generator=torch.Generator().manual_seed(half))
            q = q.to(device, dtype)
            outs = []
            for backend in (TritonDecodeBackend(shape), SDPABackend(shape)):
                k_cache, v_cache = caches[0].clone(), caches[1].clone()
                outs.append(backend.forward(q, k, v, k_cache, v_cache, layout.slot_mapping,
                                            backend.prepare(layout)).float())
            assert outs[0].shape == (layout.num_tokens, heads, value_dim)
            torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
            print(f"latent {step} heads={heads} half={half} value={value_dim} {dtype}: triton == sdpa")
            if step == "decode":
                rows = decode_rows(layout, range(len(layout.query_lens)), layout.starts, shape.block_size)
                for splits in (1, 3, MAX_SPLITS):
                    got = decode(q, k_cache, v_cache, rows.block_tables, rows.seq_lens, shape.scale, value_dim,
                                 splits=splits).float()
                    torch.testing.assert_close(got, outs[1], atol=tol, rtol=tol)
                    print(f"latent decode heads={heads} {dtype} splits={splits}: triton == sdpa")
                # a CUDA graph's inputs (backends/worker/cuda_graphs.py): int64 lengths and a table wider than any
                # sequence needs, its extra entries stale live blocks, which the kernel must never read
                gen = torch.Generator().manual_seed(2)
                stale = torch.randint(0, NUM_BLOCKS, (len(layout.query_lens), 40), generator=gen, dtype=torch.int32)
                stale = stale.to(device)
                stale[:, :rows.block_tables.shape[1]] = rows.block_tables
                got = decode(q, k_cache, v_cache, stale, rows.seq_lens.long(), shape.scale, value_dim).float()
                torch.testing.assert_close(got, outs[1], atol=tol, rtol=tol)
                print(f"latent decode heads={heads} {dtype} from a CUDA graph's inputs: triton == sdpa")
