"""Copies of whole KV blocks out of and into the paged cache: one block is K and V of every layer,
`block_nbytes` bytes, in the order [layer, K/V, token, head, channel] of the stacked cache tensor
(backends/worker/kv_cache.py). The tiers keep these bytes as they are.

On CPU the copies go through numpy and are done when they return: single-threaded, so the loader and
writer threads never start a second OpenMP team beside the engine's.

On CUDA they go through pinned host memory and return at once; `wait(pending)` blocks until one has
landed. A copy out (`read`, the engine thread, as the pool evicts a block) is queued on the compute
stream, so it comes after the kernels that wrote the block and before any that reuse it, and the
engine thread never waits for it. Copies in (`write`, the loader thread) go on a stream of their own,
behind what the compute stream had queued when the load began (`begin_writes`): a block's earlier
owner has finished with it, and the copies overlap the steps that run meanwhile.
"""
from __future__ import annotations

import numpy as np
import torch

Pending = torch.cuda.Event | None     # a copy in flight on CUDA; None: done


class BlockIO:
    def __init__(self, *stacks: torch.Tensor) -> None:
        """`stacks`: the cache as one contiguous [num_layers, 2, num_blocks, block_size, heads, dim] tensor; on the
        CPU, a group's ranks' caches (backends/executor/group_kv.py), whose parts of a block follow each other in
        its bytes, in rank order."""
        for stacked in stacks:
            if stacked.dim() != 6 or stacked.shape[1] != 2 or not stacked.is_contiguous():
                raise ValueError("expected the contiguous [layers, 2, blocks, block_size, heads, dim] KV cache")
        self.device = stacks[0].device
        if len(stacks) > 1 and self.device.type != "cpu":
            raise ValueError("a KV cache in more than one part is read and written on the CPU only")
        parts = [stacked.view(torch.uint8) for stacked in stacks]   # [L, 2, N, bs, h, d * itemsize]
        self._bytes = parts[0]
        self._shape = (self._bytes.shape[0], 2, *self._bytes.shape[3:])
        self.num_blocks = stacks[0].shape[2]
        self.block_nbytes = sum(int(np.prod((part.shape[0], 2, *part.shape[3:]))) for part in parts)
        # CPU: each part's array, the shape of its share of a block, and where that share starts in the block
        self._numpy: list[tuple[np.ndarray, tuple[int, ...], int]] | None = None
        if self.device.type == "cpu":
            self._numpy, start = [], 0
            for part in parts:
                shape = (part.shape[0], 2, *part.shape[3:])
                self._numpy.append((part.numpy(), shape, start))
                start += int(np.prod(shape))
        if self.device.type == "cuda":
            self._compute = torch.cuda.default_stream(self.device)   # where the engine's steps run
            self._loads = torch.cuda.Stream(self.device)

    def buffer(self) -> np.ndarray:
        """A host buffer for one block (pinned when the cache is on CUDA)."""
        pinned = self.device.type == "cuda"
        return torch.empty(self.block_nbytes, dtype=torch.uint8, pin_memory=pinned).numpy()

    def read(self, block_id: int, out: np.ndarray) -> Pending:
        """Copy block `block_id` into `out` (uint8, block_nbytes; pinned on CUDA)."""
        if self._numpy is not None:
            flat = out.reshape(-1)
            for array, shape, start in self._numpy:
                np.copyto(flat[start:start + int(np.prod(shape))].reshape(shape), array[:, :, block_id])
            return None
        view = out.reshape(self._shape)
        with torch.cuda.stream(self._compute):
            torch.from_numpy(view).copy_(self._bytes[:, :, block_id], non_blocking=True)
            return _recorded(self._compute)

    def begin_writes(self) -> None:
        """Before a load's `write`s: they follow everything the compute stream has queued so far."""
        if self._numpy is None:
            self._loads.wait_stream(self._compute)

    def write(self, block_id: int, data: np.ndarray) -> Pending:
        """Overwrite block `block_id` with `data` (uint8, block_nbytes; pinned on CUDA, and left untouched
        until the copy has landed)."""
        if self._numpy is not None:
            flat = data.reshape(-1)
            for array, shape, start in self._numpy:
                np.copyto(array[:, :, block_id], flat[start:start + int(np.prod(shape))].reshape(shape))
            return None
        view = data.reshape(self._shape)
        with torch.cuda.stream(self._loads):
            self._bytes[:, :, block_id].copy_(torch.from_numpy(view), non_blocking=True)
            return _recorded(self._loads)

    @staticmethod
    def wait(pending: Pending) -> None:
        if pending is not None:
            pending.synchronize()


class StagingRing:
    """Host buffers for copies in from tiers that copy out (`get`): on CUDA a few pinned ones, each handed
    out again only once its last copy has landed, so reading the next block overlaps copying this one."""

    def __init__(self, block_io: BlockIO, size: int = 4) -> None:
        self._buffers = [block_io.buffer() for _ in range(size if block_io.device.type == "cuda" else 1)]
        self._pending: list[Pending] = [None] * len(self._buffers)
        self._index = 0

    def take(self) -> np.ndarray:
        """The next buffer, free to overwrite."""
        self._index = (self._index + 1) % len(self._buffers)
        BlockIO.wait(self._pending[self._index])
        self._pending[self._index] = None
        return self._buffers[self._index]

    def copying(self, pending: Pending) -> None:
        """The buffer `take` gave last is being copied from until `pending` lands."""
        self._pending[self._index] = pending


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event
