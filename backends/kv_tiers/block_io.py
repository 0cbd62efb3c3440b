"""Copies of whole KV blocks out of and into the paged cache: one block is K and V of every layer,
`block_nbytes` bytes, in the order [layer, K/V, token, head, channel] of the stacked cache tensor
(backends/worker/kv_cache.py). The tiers keep these bytes as they are.

On CPU the copies go through numpy: single-threaded, so the loader and writer threads never start a
second OpenMP team beside the engine's. On CUDA they go through pinned host buffers and wait for
the copy before returning.
"""
from __future__ import annotations

import numpy as np
import torch


class BlockIO:
    def __init__(self, stacked: torch.Tensor) -> None:
        """`stacked`: the cache as one contiguous [num_layers, 2, num_blocks, block_size, heads, dim] tensor."""
        if stacked.dim() != 6 or stacked.shape[1] != 2 or not stacked.is_contiguous():
            raise ValueError("expected the contiguous [layers, 2, blocks, block_size, heads, dim] KV cache")
        self.device = stacked.device
        self._bytes = stacked.view(torch.uint8)   # [L, 2, N, bs, h, d * itemsize]
        self._shape = (self._bytes.shape[0], 2, *self._bytes.shape[3:])
        self.num_blocks = stacked.shape[2]
        self.block_nbytes = int(np.prod(self._shape))
        self._numpy = self._bytes.numpy() if self.device.type == "cpu" else None

    def buffer(self) -> np.ndarray:
        """A host buffer for one block (pinned when the cache is on CUDA)."""
        pinned = self.device.type == "cuda"
        return torch.empty(self.block_nbytes, dtype=torch.uint8, pin_memory=pinned).numpy()

    def read(self, block_id: int, out: np.ndarray) -> None:
        """Copy block `block_id` into `out` (uint8, block_nbytes)."""
        view = out.reshape(self._shape)
        if self._numpy is not None:
            np.copyto(view, self._numpy[:, :, block_id])
        else:
            torch.from_numpy(view).copy_(self._bytes[:, :, block_id])
            torch.cuda.synchronize(self.device)

    def write(self, block_id: int, data: np.ndarray) -> None:
        """Overwrite block `block_id` with `data` (uint8, block_nbytes)."""
        view = data.reshape(self._shape)
        if self._numpy is not None:
            np.copyto(self._numpy[:, :, block_id], view)
        else:
            self._bytes[:, :, block_id].copy_(torch.from_numpy(view), non_blocking=True)
            torch.cuda.synchronize(self.device)
