"""DeepSeek-V3's block-scaled FP8 dequantization against transformers' own (bit for bit in float32), a
round trip within e4m3's rounding, chunking, and what the loader refuses."""
from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

from backends.worker import fp8_blocks
from backends.worker.fp8_blocks import Fp8BlockScheme, dequantize_blocks, dequantize_checkpoint, fp8_block_scheme
from tests.backends import fp8_reference

DEEPSEEK = Fp8BlockScheme(block_rows=128, block_cols=128)
CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3", "activation_scheme": "dynamic"}


def random_fp8(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-rows // 128), -(-cols // 128), generator=generator) * 1e-2 + 1e-5
    return weight, scale_inv


# (rows, cols): whole blocks; DeepSeek-V3's kv_a_proj_with_mqa (576 = 4.5 blocks of rows); partial both ways;
# smaller than one block
@pytest.mark.parametrize("rows, cols", [(256, 384), (576, 896), (300, 200), (5, 7)])
def test_float32_dequantization_equals_transformers(rows: int, cols: int) -> None:
    weight, scale_inv = random_fp8(rows, cols, seed=rows)
    ours = dequantize_blocks(weight, scale_inv, DEEPSEEK, torch.float32)
    # exact: one float32 product per element on both sides (transformers' path for the backward pass, which
    # takes edge blocks)
    assert torch.equal(ours, _dequantize_fp8_weight(weight, scale_inv, [128, 128], torch.float32))
    assert torch.equal(ours, fp8_reference.dequantize_blocks(weight, scale_inv, (128, 128)))
    if rows % 128 == 0 and cols % 128 == 0:   # transformers' loading path refuses edge blocks
        for dtype in (torch.float32, torch.bfloat16):
            expected = Fp8Dequantize(None)._dequantize_one(weight, scale_inv, dtype)
            assert torch.equal(dequantize_blocks(weight, scale_inv, DEEPSEEK, dtype), expected), dtype


def test_bfloat16_is_the_float32_product_rounded_once() -> None:
    weight, scale_inv = random_fp8(300, 200, seed=1)
    ours = dequantize_blocks(weight, scale_inv, DEEPSEEK, torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, dequantize_blocks(weight, scale_inv, DEEPSEEK, torch.float32).bfloat16())


@pytest.mark.parametrize("chunk_elements", [1, 4 * 24 * 3 + 5, 10**9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_give_the_whole_matrix(chunk_elements: int, dtype: torch.dtype,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of one row block, of three (a budget that is not whole blocks rounds down) and of the whole matrix;
    23 rows end in a partial block: the same bits as the reference's one product."""
    scheme = Fp8BlockScheme(block_rows=4, block_cols=8)
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(23, 24, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(6, 3, generator=generator) + 0.5
    whole = fp8_reference.dequantize_blocks(weight, scale_inv, (4, 8)).to(dtype)
    monkeypatch.setattr(fp8_blocks, "CHUNK_ELEMENTS", chunk_elements)
    assert torch.equal(dequantize_blocks(weight, scale_inv, scheme, dtype), whole)


def test_round_trip_is_within_e4m3_rounding() -> None:
    """Quantized with per-block absmax / 448 scales and dequantized, each weight is within half an e4m3 step:
    2^-4 of itself for normal values, 2^-10 of its block's scale below e4m3's smallest normal (2^-6)."""
    generator = torch.Generator().manual_seed(4)
    # blocks of very different magnitudes, and a block of zeros
    original = torch.randn(300, 260, generator=generator) * torch.logspace(-4, 2, 300)[:, None]
    original[:128, :128] = 0
    weight, scale_inv = fp8_reference.quantize_blocks(original, (128, 128))
    back = dequantize_blocks(weight, scale_inv, DEEPSEEK, torch.float32)
    scale = fp8_reference.expand_scales(scale_inv, (300, 260), (128, 128))
    bound = torch.maximum(original.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)   # + float32's own rounding
    assert ((back - original).abs() <= bound).all()
    assert torch.equal(back[:128, :128], torch.zeros(128, 128))


def test_checkpoint_drops_scales_and_keeps_other_tensors() -> None:
    weight, scale_inv = random_fp8(130, 140, seed=5)
    norm = torch.ones(140, dtype=torch.bfloat16)
    out = dequantize_checkpoint({"a.weight": weight, "a.weight_scale_inv": scale_inv, "norm.weight": norm},
                                DEEPSEEK, torch.float32)
    assert set(out) == {"a.weight", "norm.weight"} and out["norm.weight"] is norm
    assert torch.equal(out["a.weight"], fp8_reference.dequantize_blocks(weight, scale_inv, (128, 128)))


@pytest.mark.parametrize("tensors, message", [
    ({"a.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, "has no a.weight_scale_inv"),
    ({"a.weight": torch.zeros(4, 4), "a.weight_scale_inv": torch.ones(1, 1)}, "scales no float8_e4m3fn"),
    ({"a.weight_scale_inv": torch.ones(1, 1)}, "scales no float8_e4m3fn tensor a.weight"),
    ({"a.weight": torch.zeros(4, 4, dtype=torch.float8_e5m2)}, "only float8_e4m3fn"),
    ({"a.weight": torch.zeros(200, 4, dtype=torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(1, 1)},
     r"a.weight_scale_inv has shape \(1, 1\); a 200x4 matrix in 128x128 blocks needs \(2, 1\)"),
    ({"a.weight": torch.zeros(2, 4, 4, dtype=torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(1, 1)},
     "a float8 matrix is expected"),
])
def test_inconsistent_checkpoints_are_refused(tensors: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dequantize_checkpoint(tensors, DEEPSEEK, torch.float32)


def test_scheme_of_deepseek_config() -> None:
    assert fp8_block_scheme({"quantization_config": CONFIG}) == DEEPSEEK
    assert fp8_block_scheme({"quantization_config": {**CONFIG, "weight_block_size": [64, 32]}}) == \
        Fp8BlockScheme(block_rows=64, block_cols=32)
    assert fp8_block_scheme({"hidden_size": 8}) is None


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"fmt": "e5m2"}, "fmt"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"weight_block_size": None}, "per-tensor FP8 scales are not supported"),
    ({"weight_block_size": [128]}, "two positive integers"),
    ({"weight_block_size": [128, 0]}, "two positive integers"),
])
def test_unsupported_schemes_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fp8_block_scheme({"quantization_config": {**CONFIG, **change}})
