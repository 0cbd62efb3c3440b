"""One rank's slices of a safetensors checkpoint: each tensor read through safetensors' mmap (`get_slice`) as the
rows or columns the rank's `TPLayout` names, never the whole model; replicated tensors (norms) whole.

A compressed folder (`switchyard compress`) is read the same way, each slice decoded from the chunks that hold it
(backends/worker/compressed_slices.py). A block-scaled FP8 one is refused over a group, with the reason, rather than
read whole.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from backends.models.tensor_parallel import TPLayout
from backends.worker.compressed_slices import CompressedSlices
from backends.worker.fingerprint import tensor_line
from backends.worker.loader import COMPRESSED_FORMAT_KEY, checkpoint_files


class ShardReader(Mapping[str, torch.Tensor]):
    """A rank's part of every tensor in a folder, by HF name, read out of the mapped files when asked for (so a
    tensor's copy is freed once the model has placed it); `read_bytes` counts what was read. A context manager:
    the files stay open until it exits. `lines`: each tensor read's part of the rank's weights fingerprint
    (backends/worker/fingerprint.py), so that two groups of one shape can tell whether they hold the same weights."""

    def __init__(self, folder: Path, layout: TPLayout | None) -> None:
        """`layout`: the rank's tensor-parallel slices; None: whole tensors (a pipeline stage of one rank, which
        asks for its own layers' only)."""
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if config.get("quantization_config"):
            raise ValueError(f"{folder} is quantized ({config['quantization_config'].get('quant_method')}): a "
                             "group of ranks reads plain or compressed safetensors only")
        self.layout = layout
        self.read_bytes = 0
        self.lines: list[str] = []
        self._stack = ExitStack()
        self._files: dict[str, Any] = {}
        for path in checkpoint_files(folder)[0]:
            file = self._stack.enter_context(safe_open(str(path), framework="pt"))
            if COMPRESSED_FORMAT_KEY in (file.metadata() or {}):
                compressed = CompressedSlices(path)
                self._files.update(dict.fromkeys(compressed.names(), compressed))
            else:
                self._files.update(dict.fromkeys(file.keys(), file))

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __getitem__(self, name: str) -> torch.Tensor:
        rows = None if self.layout is None else self.layout.rows_of(name)
        file = self._files[name]
        if isinstance(file, CompressedSlices):
            tensor, read = file.read(name, rows)
            self.read_bytes += read
        else:
            tensor = _read_slice(file.get_slice(name), rows)
            self.read_bytes += tensor.numel() * tensor.element_size()
        self.lines.append(tensor_line(name, tensor))
        return tensor

    def __contains__(self, name: object) -> bool:   # Mapping's own would read the tensor to find out
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


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
