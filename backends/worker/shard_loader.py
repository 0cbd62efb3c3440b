"""One rank's slices of a safetensors checkpoint: each tensor read through safetensors' mmap (`get_slice`) as the
rows or columns the rank's `TPLayout` names, never the whole model; replicated tensors (norms) whole.

Plain safetensors only: a compressed folder (`switchyard compress`) or a block-scaled FP8 one is refused over a
group, with the reason, rather than read whole.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from backends.models.tensor_parallel import TPLayout
from backends.worker.loader import COMPRESSED_FORMAT_KEY, checkpoint_files


def load_weight_shards(folder: Path, layout: TPLayout) -> tuple[dict[str, torch.Tensor], int]:
    """Rank `layout.rank`'s part of every tensor in `folder`, by HF name, and the bytes it read."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("quantization_config"):
        raise ValueError(f"{folder} is quantized ({config['quantization_config'].get('quant_method')}): a "
                         "tensor-parallel group reads plain safetensors only")
    files, _ = checkpoint_files(folder)
    weights: dict[str, torch.Tensor] = {}
    read = 0
    for path in files:
        with safe_open(str(path), framework="pt") as file:
            if COMPRESSED_FORMAT_KEY in (file.metadata() or {}):
                raise ValueError(f"{path} holds compressed weights: a tensor-parallel group reads plain "
                                 "safetensors only")
            for name in file.keys():  # noqa: SIM118 - safe_open is no Mapping
                tensor = _read_slice(file.get_slice(name), layout.rows_of(name))
                weights[name] = tensor
                read += tensor.numel() * tensor.element_size()
    return weights, read


def _read_slice(part: object, rows: tuple[int, int, int] | None) -> torch.Tensor:
    """The tensor's [start, stop) along `dim` (clipped to its end), or all of it; a copy out of the map."""
    if rows is None:
        return part[:]  # type: ignore[index]
    dim, start, stop = rows
    shape = part.get_shape()  # type: ignore[attr-defined]
    stop = min(stop, shape[dim])
    if dim == 0:
        return part[start:stop]  # type: ignore[index]
    return part[:, start:stop]  # type: ignore[index]
