"""A step through pipeline stages: the batch cut into micro-batches of about equal tokens, each stage running its
layers over one micro-batch while the next stage runs the one before, activations sent point to point.

Every rank of a stage runs the same schedule on the same batch (rank 0 sends each step down the ranks' pipes):
- stage 0 embeds and runs micro-batch 1, 2, ... and sends each to stage 1 without waiting; then it receives the
  last stage's normed hidden states for each in turn and computes the logits (its LM head);
- a later stage receives micro-batch i, runs its layers, sends the result on (the last stage: back to stage 0,
  only the rows that want logits unless the step asks for every token's hidden state).
Micro-batch i+1 of a stage needs micro-batch i's KV only in the same stage's cache, which that stage has just
written: a prefill cut in two runs as two chunks of a chunked prefill, and the stages overlap within one step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from backends.core.batch import ForwardBatch, SeqChunk
from backends.models.pipeline import PipelineStage
from backends.worker.model_runner import ModelRunner


@dataclass(slots=True)
class SendCounts:
    """What this rank sent to other stages since start."""
    num_sends: int = 0
    send_bytes: int = 0


class PipelineLinks:
    """This rank's point-to-point links: to its peer (the same tensor-parallel rank) in the next stage, from its
    peer in the previous one, and between the last stage and the first. Every wait is bounded by the timeout."""

    def __init__(self, rank: int, tp_size: int, stage: PipelineStage, group: dist.ProcessGroup,
                 timeout_s: float) -> None:
        self.stage = stage
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)
        peer = rank % tp_size
        self.next_rank = ((stage.index + 1) % stage.num_stages) * tp_size + peer   # the last stage's: stage 0
        self.prev_rank = ((stage.index - 1) % stage.num_stages) * tp_size + peer   # stage 0's: the last stage
        self.counts = SendCounts()

    def send(self, tensor: torch.Tensor) -> dist.Work | None:
        """Send to the next stage (the last stage: to the first) without waiting: `finish` waits. Nothing is sent
        for no rows (the receiver, which knows the rows, expects nothing)."""
        if tensor.shape[0] == 0:
            return None
        tensor = tensor.contiguous()
        self.counts.num_sends += 1
        self.counts.send_bytes += tensor.numel() * tensor.element_size()
        work = dist.isend(tensor, self.next_rank, group=self.group)
        assert work is not None   # None only for a rank outside the group
        return work

    def recv(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The next [rows, width] tensor from the previous stage (the first stage: from the last)."""
        tensor = torch.empty(rows, width, dtype=dtype, device=device)
        if rows == 0:
            return tensor
        work = dist.irecv(tensor, self.prev_rank, group=self.group)
        assert work is not None
        work.wait(self.timeout)
        return tensor

    def finish(self, sends: list[dist.Work | None]) -> None:
        """Wait for these sends to complete."""
        for work in sends:
            if work is not None:
                work.wait(self.timeout)


def micro_batches(batch: ForwardBatch, count: int) -> list[ForwardBatch]:
    """`batch` cut into at most `count` contiguous micro-batches of about equal tokens, in order. A chunk may be
    cut (its first part then runs as a prefill chunk that wants no logits), never inside its logits rows: such a
    cut moves to the chunk's end."""
    cuts = [batch.num_tokens * k // count for k in range(1, count)]   # flat token positions that end a part
    parts: list[list[SeqChunk]] = [[]]
    start = 0   # the flat position of `chunk`'s first token
    for chunk in batch.chunks:
        end = start + len(chunk.token_ids)
        latest = end - (chunk.num_logits if chunk.want_logits else 0)   # past this, a cut splits its logits rows
        cut_at_end = False
        while cuts and cuts[0] < end:
            cut = cuts.pop(0)
            if cut <= start:
                parts.append([])
            elif cut > latest:
                cut_at_end = True
            else:
                head = cut - start
                parts[-1].append(replace(chunk, token_ids=chunk.token_ids[:head], want_logits=False, num_logits=1))
                chunk = replace(chunk, token_ids=chunk.token_ids[head:],
                                num_context_tokens=chunk.num_context_tokens + head)
                start = cut
                parts.append([])
        parts[-1].append(chunk)
        if cuts and cuts[0] == end:
            cuts.pop(0)
            cut_at_end = True
        if cut_at_end:
            parts.append([])
        start = end
    return [ForwardBatch(tuple(part)) for part in parts if part]


def pipeline_step(runner: ModelRunner, links: PipelineLinks, batch: ForwardBatch,
                  all_hidden: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This rank's part of one step. Stage 0: (logits [rows, vocab], the final hidden states: of every token with
    `all_hidden`, else of the logits rows); other stages: None. ValueError, before anything is sent, for a batch
    every rank refuses alike."""
    runner.check_batch(batch)
    parts = micro_batches(batch, links.stage.num_stages)
    width, dtype, device = int(runner.config.hidden_size), runner.dtype, runner.device
    sends: list[dist.Work | None] = []
    if links.stage.is_first:
        rows: list[torch.Tensor] = []
        for part in parts:
            hidden, logits_rows = runner.run_layers(part)
            sends.append(links.send(hidden))
            rows.append(logits_rows)
        finals = [links.recv(part.num_tokens if all_hidden else len(logits_rows), width, dtype, device)
                  for part, logits_rows in zip(parts, rows, strict=True)]
        links.finish(sends)
        wanted = [h.index_select(0, r) for h, r in zip(finals, rows, strict=True)] if all_hidden else finals
        return runner.logits(torch.cat(wanted)), torch.cat(finals)
    for part in parts:
        hidden, logits_rows = runner.run_layers(part, links.recv(part.num_tokens, width, dtype, device))
        if links.stage.is_last and not all_hidden:
            hidden = hidden.index_select(0, logits_rows)
        sends.append(links.send(hidden))
    links.finish(sends)
    return None
