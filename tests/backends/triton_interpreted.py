"""Run in a subprocess by test_triton_interpreter.py, with TRITON_INTERPRET=1 set before Triton is
imported: the Triton kernels execute on the CPU (Triton's interpreter), on CPU tensors, and are compared
with their references. Prints one line per check and exits non-zero on the first mismatch."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from tests.backends import triton_checks  # noqa: E402  (after the interpreter is asserted on)


def attention() -> None:
    from backends.attention.base import AttentionShape
    from backends.attention.sdpa import SDPABackend
    from backends.attention.triton_decode import TritonDecodeBackend
    from tests.backends.test_attention_gpu import STEPS, random_step

    cpu = torch.device("cpu")
    for heads in [(8, 8, 64), (9, 3, 64), (14, 2, 64)]:
        for dtype in (torch.float32, torch.bfloat16):
            for step in sorted(STEPS):
                shape = AttentionShape(*heads, block_size=16, scale=heads[2] ** -0.5, dtype=dtype)
                layout, q, k, v, caches = random_step(shape, *STEPS[step], seed=len(step) + heads[0], device=cpu)
                outs = []
                for backend in (TritonDecodeBackend(shape), SDPABackend(shape)):
                    k_cache, v_cache = caches[0].clone(), caches[1].clone()
                    outs.append(backend.forward(q, k, v, k_cache, v_cache, layout.slot_mapping,
                                                backend.prepare(layout)))
                tol = 2e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)
                print(f"attention {step} heads={heads} {dtype}: triton == sdpa")


def static_decode() -> None:
    """The metadata a CUDA graph replays (backends/worker/cuda_graphs.py): int64 lengths, and block tables
    wider than any sequence needs, their extra entries stale (here: random live blocks), which the kernel
    must never read."""
    from backends.attention.base import AttentionShape
    from backends.attention.sdpa import SDPABackend
    from backends.attention.triton_decode import TritonDecodeBackend
    from tests.backends.test_attention_gpu import NUM_BLOCKS, STEPS, random_step

    cpu = torch.device("cpu")
    query_lens, context_lens = STEPS["decode"]
    for heads in [(8, 8, 64), (9, 3, 64), (14, 2, 64)]:
        for dtype in (torch.float32, torch.bfloat16):
            shape = AttentionShape(*heads, block_size=16, scale=heads[2] ** -0.5, dtype=dtype)
            layout, q, k, v, caches = random_step(shape, query_lens, context_lens, seed=heads[0], device=cpu)
            width = 40   # more blocks than the longest sequence (301 tokens: 19 blocks) needs
            stale = torch.Generator().manual_seed(1)
            tables = torch.randint(0, NUM_BLOCKS, (len(query_lens), width), generator=stale, dtype=torch.int32)
            for row, table in enumerate(layout.block_tables):
                tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
            seq_lens = torch.tensor([c + 1 for c in context_lens], dtype=torch.long)
            rows = torch.arange(len(query_lens))
            triton_backend, sdpa = TritonDecodeBackend(shape), SDPABackend(shape)
            outs = []
            for backend, metadata in ((triton_backend, triton_backend.static_decode_metadata(rows, tables, seq_lens)),
                                      (sdpa, sdpa.prepare(layout))):
                k_cache, v_cache = caches[0].clone(), caches[1].clone()
                outs.append(backend.forward(q, k, v, k_cache, v_cache, layout.slot_mapping, metadata))
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)
            print(f"static decode heads={heads} {dtype}: triton from graph inputs == sdpa")


def compression(work: Path) -> None:
    from safetensors.torch import save_file

    from backends.compression import compress_folder, load_compressed_file
    from backends.compression.resident import CompressedTensor, load_compressed_resident

    gen = torch.Generator().manual_seed(0)
    exponents = torch.randint(0, 256, (70, 33), generator=gen, dtype=torch.int32)   # all 256 exponents
    adversarial = ((exponents << 7) | torch.randint(0, 128, (70, 33), generator=gen, dtype=torch.int32)).to(torch.int16)
    weights = {
        "trained_like.weight": (torch.randn(300, 257, generator=gen) * 0.02).to(torch.bfloat16),   # 76 lanes
        "all_exponents.weight": adversarial.view(torch.bfloat16),
        "half.weight": torch.randn(64, 100, generator=gen).to(torch.float16),
        "norm.weight": torch.ones(10),
    }
    (work / "src").mkdir()
    save_file(weights, str(work / "src" / "model.safetensors"))
    compress_folder(work / "src", work / "out")
    file = work / "out" / "model.safetensors"
    want = load_compressed_file(file)
    for name, item in load_compressed_resident(file, "cpu").items():
        got = item.decompress(use_triton=True) if isinstance(item, CompressedTensor) else item
        # exact: both decoders are lossless
        assert torch.equal(got.reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), weights[name].reshape(-1).view(torch.uint8)), name
        print(f"compression {name}: triton decode == original bits")
    # as --keep-weights-compressed fuses q/k/v: tensors expanded into row slices of one buffer, at an
    # offset, with nothing written outside their slice
    resident = load_compressed_resident(file, "cpu")
    first, second = resident["trained_like.weight"], resident["all_exponents.weight"]
    n1, n2 = first.record.numel, second.record.numel
    buffer = torch.full((5 + n1 + n2 + 5,), 7.0, dtype=torch.bfloat16)
    first.decompress(buffer[5:5 + n1].view(first.shape), use_triton=True)
    second.decompress(buffer[5 + n1:5 + n1 + n2].view(second.shape), use_triton=True)
    want = torch.cat([weights["trained_like.weight"].reshape(-1), weights["all_exponents.weight"].reshape(-1)])
    assert torch.equal(buffer[5:5 + n1 + n2].view(torch.int16), want.view(torch.int16))   # exact: lossless
    assert (buffer[:5] == 7.0).all() and (buffer[5 + n1 + n2:] == 7.0).all()
    print("compression row slices: triton decode == original bits, nothing past the slice")


if __name__ == "__main__":
    if sys.argv[1] == "attention":
        attention()
    elif sys.argv[1] == "static_decode":
        static_decode()
    elif sys.argv[1] == "decode_splits":
        triton_checks.decode_splits(torch.device("cpu"))
    elif sys.argv[1] == "fused_layers":
        triton_checks.fused_layers(torch.device("cpu"))
        triton_checks.gemv(torch.device("cpu"))
    elif sys.argv[1] == "moe_experts":
        triton_checks.moe_experts(torch.device("cpu"))
    elif sys.argv[1] == "latent_decode":
        triton_checks.latent_decode(torch.device("cpu"))
    else:
        compression(Path(sys.argv[2]))
