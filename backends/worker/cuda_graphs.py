"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured once at start.

A decode step of a small model is hundreds of tiny kernels, and launching them one by one from Python
costs more than running them: SmolLM2's step took 10-20 ms eagerly on an H100, and about 2 ms replayed
as a graph, which launches them all at once.

A decode-only step (each chunk one new token that wants its logits) of n sequences replays the graph
of the smallest bucket that holds n. Its inputs live in fixed tensors that every replay reads; the step
copies its token ids, positions, cache slots, lengths and block tables into them. Rows past n repeat
row 0: the same token at the same position writes the same K/V into the same slot, and their outputs
are dropped. Block tables are as wide as `max_model_len` needs; the kernel reads only the entries a
sequence's length covers, so stale entries past them are never read.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backends.core.batch import ForwardBatch

log = logging.getLogger(__name__)

def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to and including `max_batch`."""
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    sizes = {n for n in (1, 2, 4) if n <= max_batch} | set(range(8, max_batch + 1, 8)) | {max_batch}
    return tuple(sorted(sizes))


def is_plain_decode(batch: ForwardBatch) -> bool:
    """Every chunk is one new token wanting its own logits (no prefill, no drafts to verify)."""
    return all(len(c.token_ids) == 1 and c.want_logits and c.num_logits == 1 for c in batch.chunks)


@dataclass(frozen=True, slots=True)
class StaticInputs:
    """What a captured graph reads."""
    table: torch.Tensor         # [4, max_batch] int64: token ids, positions, cache slots, lengths (one row each)
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int32
    rows: torch.Tensor          # [max_batch] int64: 0..max_batch-1 (the step's token of each row)


def pack_decode_inputs(batch: ForwardBatch, bucket: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's [4, bucket] int64 input table and its [bucket, width] int32 block tables (width: the
    most blocks any sequence's length needs), rows past the batch repeating row 0."""
    chunks = batch.chunks
    if not 1 <= len(chunks) <= bucket:
        raise ValueError(f"{len(chunks)} sequences do not fit a bucket of {bucket}")
    chunks = (*chunks, *(chunks[0],) * (bucket - len(chunks)))
    ids = [c.token_ids[0] for c in chunks]
    positions = [c.num_context_tokens for c in chunks]
    slots = [c.block_table[p // block_size] * block_size + p % block_size
             for c, p in zip(chunks, positions, strict=True)]
    lens = [p + 1 for p in positions]
    width = max(-(-n // block_size) for n in lens)
    tables = [list(c.block_table[:width]) + [0] * (width - min(width, len(c.block_table))) for c in chunks]
    return torch.tensor([ids, positions, slots, lens], dtype=torch.long), torch.tensor(tables, dtype=torch.int32)


# The forward a graph captures: (inputs, batch size) -> (float32 logits [n, vocab], hidden [n, hidden]).
StaticForward = Callable[[StaticInputs, int], tuple[torch.Tensor, torch.Tensor]]


class DecodeGraphs:
    """Captures `forward` for each bucket on `device` and replays the right one for a decode step."""

    def __init__(self, forward: StaticForward, *, device: torch.device, max_batch: int, max_blocks_per_seq: int,
                 block_size: int) -> None:
        self.buckets = graph_buckets(max_batch)
        self.block_size = block_size
        self.inputs = StaticInputs(
            table=torch.zeros((4, max_batch), dtype=torch.long, device=device),
            block_tables=torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.int32, device=device),
            rows=torch.arange(max_batch, dtype=torch.long, device=device))
        self.inputs.table[3].fill_(1)   # lengths: during capture every row attends to slot 0 of block 0 alone
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bucket in reversed(self.buckets):   # largest first: the smaller ones fit in its pool
                forward(self.inputs, bucket)         # warm-up outside the graph: Triton compiles, cuBLAS plans
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[bucket] = forward(self.inputs, bucket)
                self._graphs[bucket] = graph
        torch.cuda.synchronize(device)
        log.info("captured %d CUDA graphs for decode batches up to %d in %.2f s (%.0f MiB)", len(self.buckets),
                 max_batch, time.perf_counter() - started, (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def covers(self, batch: ForwardBatch) -> bool:
        return 0 < len(batch.chunks) <= self.max_batch and is_plain_decode(batch)

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] and hidden states [n, hidden] of a decode step `covers` accepts (copies:
        the next replay overwrites the graph's own outputs)."""
        n = len(batch.chunks)
        bucket = self.bucket_for(n)
        table, tables = pack_decode_inputs(batch, bucket, self.block_size)
        self.inputs.table[:, :bucket].copy_(table, non_blocking=True)
        self.inputs.block_tables[:bucket, :tables.shape[1]].copy_(tables, non_blocking=True)
        self._graphs[bucket].replay()
        logits, hidden = self._outputs[bucket]
        return logits[:n].clone(), hidden[:n].clone()
