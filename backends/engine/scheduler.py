"""Continuous batching: which sequences run in the next step, and how many tokens each.

Per step, within a token budget and `max_num_seqs`: running decodes first (one token each),
then chunked prefill of admitted sequences, then admission of waiting ones by free blocks.
Preempts by recompute (newest first) when blocks run out. Never runs the model or samples.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from backends.engine.block_manager import BlockManager
from backends.engine.outputs import FinishReason
from backends.engine.sequence import Sequence, SequenceStatus
from backends.worker.batch import ForwardBatch, SeqChunk

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence            # the sequence (engine-thread object, not a cross-boundary record)
    num_new_tokens: int      # tokens it runs this step
    want_logits: bool        # the chunk reaches its last token, so a token is sampled


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    batch: ForwardBatch                   # what the runner executes; chunks parallel to `scheduled`
    scheduled: tuple[ScheduledSeq, ...]   # one per chunk
    preempted: tuple[Sequence, ...]       # sent back to waiting this step (recompute later)
    failed: tuple[Sequence, ...]          # finished with an error this step (can never fit)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, watermark_blocks: int = 1) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []             # admission order; preemption takes the tail
        self.awaiting_kv: dict[str, Sequence] = {}
        self._seqs: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # --- queries ------------------------------------------------------------------------------
    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.awaiting_kv)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def num_prefill_tokens_pending(self) -> int:
        return sum(s.num_uncomputed_tokens for s in self._seqs.values() if s.is_prefilling)

    def num_decode_tokens_pending(self) -> int:
        return sum(max(0, s.params.max_tokens - s.num_output_tokens) for s in self._seqs.values())

    # --- lifecycle ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if not 0 < seq.num_tokens <= self.max_model_len:
            raise ValueError(f"prompt of {seq.num_tokens} tokens outside (0, {self.max_model_len}]")
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
               hold_blocks: bool = False) -> int | None:
        """End seq and free its blocks (or pin them under a returned handle)."""
        if seq.is_finished:
            return None
        self._detach(seq)
        handle = self.block_manager.hold(seq) if hold_blocks else None
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        return handle

    def abort(self, request_id: str, error: str | None = None) -> Sequence | None:
        """Cancel at once, freeing blocks; None if unknown or already finished (idempotent)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self.finish(seq, FinishReason.ABORT, error)
        return seq

    def remote_kv_ready(self, request_id: str, num_computed_tokens: int) -> bool:
        """The prompt KV of a remote_kv sequence has been written for its first tokens."""
        seq = self.awaiting_kv.pop(request_id, None)
        if seq is None:
            return False
        seq.num_computed_tokens = max(seq.num_computed_tokens, min(num_computed_tokens, seq.num_tokens - 1))
        seq.remote_kv = False              # the KV has arrived; a later recompute is local
        self.block_manager.cache_computed_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _detach(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.AWAITING_REMOTE_KV:
            self.awaiting_kv.pop(seq.request_id, None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _fail_oversized(self, seq: Sequence) -> None:
        needed = self.block_manager.blocks_needed(seq.num_tokens)
        self.finish(seq, FinishReason.ABORT, f"sequence needs {needed} KV blocks but the cache has "
                    f"{self.block_manager.num_total_blocks}")

    # --- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.max_num_batched_tokens)
        self._schedule_decodes(plan)
        self._schedule_prefill_chunks(plan)
        if not plan.preempted:
            self._admit_waiting(plan)
        chunks = tuple(self._chunk(s) for s in plan.scheduled)
        return SchedulerOutput(ForwardBatch(chunks), tuple(plan.scheduled), tuple(plan.preempted),
                               tuple(plan.failed))

    def _schedule_decodes(self, plan: _StepPlan) -> None:
        for seq in list(self.running):
            if plan.budget <= 0 or len(plan.scheduled) >= self.max_num_seqs:
                return
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling:
                continue
            if self._make_room(seq, plan):
                self.block_manager.append_slots(seq, 1)
                plan.add(seq, 1, True)

    def _make_room(self, seq: Sequence, plan: _StepPlan) -> bool:
        """Preempt newest unscheduled sequences until seq can grow by one token; False if seq
        itself had to go (preempted, or failed when it can never fit)."""
        while not self.block_manager.can_append_slots(seq, 1):
            victim = next((s for s in reversed(self.running)
                           if s is not seq and not plan.is_scheduled(s)), None)
            if victim is not None:
                self._preempt(victim)
                plan.preempted.append(victim)
                continue
            if self.block_manager.blocks_needed(seq.num_tokens) > self.block_manager.num_total_blocks:
                self._fail_oversized(seq)
                plan.failed.append(seq)
            else:
                self._preempt(seq)
                plan.preempted.append(seq)
            return False
        return True

    def _schedule_prefill_chunks(self, plan: _StepPlan) -> None:
        for seq in self.running:
            if plan.budget <= 0 or len(plan.scheduled) >= self.max_num_seqs:
                return
            if seq.is_prefilling and not plan.is_scheduled(seq):
                n = min(seq.num_uncomputed_tokens, plan.budget)
                plan.add(seq, n, seq.num_computed_tokens + n == seq.num_tokens)

    def _admit_waiting(self, plan: _StepPlan) -> None:
        bm = self.block_manager
        while self.waiting and plan.budget > 0 and len(plan.scheduled) < self.max_num_seqs \
                and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if bm.blocks_needed(seq.num_tokens) > bm.num_total_blocks:
                self._fail_oversized(seq)
                plan.failed.append(seq)
                continue
            # Alone in the engine, a sequence may use every block; otherwise keep the watermark.
            watermark = self.watermark_blocks if (self.running or self.awaiting_kv) else 0
            num_cached = bm.allocate(seq, watermark)
            if num_cached is None:
                return
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            if seq.remote_kv:
                seq.status = SequenceStatus.AWAITING_REMOTE_KV
                self.awaiting_kv[seq.request_id] = seq
                continue
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, plan.budget)
            plan.add(seq, n, seq.num_computed_tokens + n == seq.num_tokens)

    def _chunk(self, s: ScheduledSeq) -> SeqChunk:
        seq, start = s.seq, s.seq.num_computed_tokens
        end = start + s.num_new_tokens
        table = seq.block_table[:self.block_manager.blocks_needed(end)]
        return SeqChunk(tuple(seq.token_ids[start:end]), start, tuple(table), s.want_logits)

    def postprocess(self, out: SchedulerOutput) -> None:
        """After the runner wrote the step's KV: advance progress and publish full blocks."""
        for s in out.scheduled:
            if s.seq.is_finished:
                continue
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_computed_blocks(s.seq)


class _StepPlan:
    """Scratch state of one schedule() call."""

    __slots__ = ("budget", "scheduled", "preempted", "failed", "_ids")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled: list[ScheduledSeq] = []
        self.preempted: list[Sequence] = []
        self.failed: list[Sequence] = []
        self._ids: set[int] = set()

    def add(self, seq: Sequence, num_new_tokens: int, want_logits: bool) -> None:
        self.scheduled.append(ScheduledSeq(seq, num_new_tokens, want_logits))
        self._ids.add(id(seq))
        self.budget -= num_new_tokens

    def is_scheduled(self, seq: Sequence) -> bool:
        return id(seq) in self._ids
