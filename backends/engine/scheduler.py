"""Continuous batching: which sequences run in the next step, and how many tokens each.

Per step, within a token budget and `max_num_seqs`: running decodes first (one token each, plus
the drafts a proposer gave it where budget and free blocks allow),
then chunked prefill of admitted sequences, then admission of waiting ones by free blocks. An
embedding input is a prompt like any other until its last chunk, which is pooled instead of sampled.
Preempts by recompute (newest first) when blocks run out. Consults the optional KV connector for
KV from outside the pool (a sequence waits for its load in WAITING_FOR_REMOTE_KV, then takes its
admission place among the running) and for blocks to keep after a sequence finishes. Never runs the
model, samples, or does I/O.
"""
from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass

from backends.core.batch import ForwardBatch, SeqChunk
from backends.core.block_manager import BlockManager
from backends.core.outputs import FinishReason
from backends.core.sequence import Sequence, SequenceStatus
from backends.kv_connectors.base import KVConnector

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence            # the sequence (engine-thread object, not a cross-boundary record)
    num_new_tokens: int      # tokens it runs this step
    want_logits: bool        # the chunk reaches its last token, so a token is sampled
    num_spec_tokens: int = 0 # drafts verified after its last token (seq.spec_token_ids[:num_spec_tokens])
    want_embedding: bool = False  # an embedding's last chunk: its last token's hidden state is pooled (no logits)


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
                 max_model_len: int, watermark_blocks: int = 1, kv_connector: KVConnector | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.watermark_blocks = watermark_blocks
        self.kv_connector = kv_connector
        self.waiting: deque[Sequence] = deque()
        # Admission order, loaded sequences included: a sequence that waited for its KV takes its prefill
        # budget before those admitted while it loaded, and preemption takes the newest admitted (the tail).
        self.running: list[Sequence] = []
        self._num_admitted = 0
        self.waiting_for_remote_kv: dict[str, Sequence] = {}
        self._seqs: dict[str, Sequence] = {}
        self._held: dict[str, int] = {}               # finished, blocks kept for a transfer: request id -> hold handle
        self._loading_finished: dict[str, Sequence] = {}   # finished while a load still wrote its blocks
        self.num_preemptions = 0

    # --- queries ------------------------------------------------------------------------------
    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_remote_kv)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def num_prefill_tokens_pending(self) -> int:
        return sum(s.num_uncomputed_tokens for s in self._seqs.values() if s.is_prefilling)

    def num_decode_tokens_pending(self) -> int:
        return sum(max(0, s.params.max_tokens - s.num_output_tokens) for s in self._seqs.values()
                   if s.params is not None)

    # --- lifecycle ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if not 0 < seq.num_tokens <= self.max_model_len:
            raise ValueError(f"prompt of {seq.num_tokens} tokens outside (0, {self.max_model_len}]")
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End seq and free its blocks, unless the KV connector keeps them for a while."""
        if seq.is_finished:
            return
        was_loading = seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV
        self._detach(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        if self.kv_connector is None or not self.kv_connector.request_finished(seq):
            self.block_manager.free(seq)
        elif was_loading:           # a load still writes these blocks: free them once it ends
            self._loading_finished[seq.request_id] = seq
        else:
            self._held[seq.request_id] = self.block_manager.hold(seq)

    def abort(self, request_id: str, error: str | None = None) -> Sequence | None:
        """Cancel at once, freeing blocks; None if unknown or already finished (idempotent)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self.finish(seq, FinishReason.ABORT, error)
        return seq

    def abort_all(self, error: str) -> list[Sequence]:
        """Abort every live sequence but those waiting for a load: only their own request ends
        them, so that a failure of the engine loop cannot free blocks a load still writes."""
        live = [s for s in self._seqs.values() if s.status is not SequenceStatus.WAITING_FOR_REMOTE_KV]
        for seq in live:
            self.finish(seq, FinishReason.ABORT, error)
        return live

    def _update_from_connector(self, plan: _StepPlan) -> None:
        """Apply the connector's finished transfers: kept blocks go, loaded sequences run."""
        assert self.kv_connector is not None
        finished = self.kv_connector.get_finished()
        for request_id in finished.sent:
            handle = self._held.pop(request_id, None)
            if handle is not None:
                self.block_manager.release(handle)
        for result in finished.loaded:
            done = self._loading_finished.pop(result.request_id, None)
            if done is not None:
                self.block_manager.free(done)
                continue
            seq = self.waiting_for_remote_kv.get(result.request_id)
            if seq is None:
                continue
            if result.error is not None:     # the load is over, so its blocks are free to go
                self.finish(seq, FinishReason.ABORT, result.error)
                plan.failed.append(seq)
                continue
            del self.waiting_for_remote_kv[result.request_id]
            loaded = seq.num_external_tokens if result.num_tokens is None else result.num_tokens
            seq.num_computed_tokens = min(seq.num_computed_tokens + loaded, seq.num_tokens - 1)
            if result.num_tokens is not None and seq.num_preemptions == 0:   # a tier's prefix hit
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            seq.num_external_tokens = 0
            seq.kv_transfer = None       # the KV has arrived; a later recompute is local
            self.block_manager.cache_computed_blocks(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.admission)

    def _detach(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            self.waiting_for_remote_kv.pop(seq.request_id, None)

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
        if self.kv_connector is not None:
            self._update_from_connector(plan)
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
            # Drafts ride along only where budget and free blocks allow; they never preempt anyone.
            k = min(len(seq.spec_token_ids), plan.budget - 1)
            if k > 0 and not self.block_manager.can_append_slots(seq, 1 + k):
                k = 0
            if self._make_room(seq, plan):
                self.block_manager.append_slots(seq, 1 + k)
                plan.add(seq, 1 + k, True, k)

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
            watermark = self.watermark_blocks if (self.running or self.waiting_for_remote_kv) else 0
            num_cached = bm.allocate(seq, watermark)
            if num_cached is None:
                return
            self.waiting.popleft()
            seq.admission = self._num_admitted
            self._num_admitted += 1
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            if self._load_external(seq):
                continue
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, plan.budget)
            plan.add(seq, n, seq.num_computed_tokens + n == seq.num_tokens)

    def _load_external(self, seq: Sequence) -> bool:
        """Admitted seq has KV for the connector to load: it waits for that in its own state."""
        connector = self.kv_connector
        num_external = None if connector is None else connector.get_num_new_matched_tokens(seq, seq.num_computed_tokens)
        if connector is None or num_external is None:
            return False
        seq.num_external_tokens = num_external
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote_kv[seq.request_id] = seq
        connector.update_state_after_alloc(seq, num_external)
        return True

    def _chunk(self, s: ScheduledSeq) -> SeqChunk:
        seq, start = s.seq, s.seq.num_computed_tokens
        end = start + s.num_new_tokens - s.num_spec_tokens
        table = seq.block_table[:self.block_manager.blocks_needed(end + s.num_spec_tokens)]
        tokens = tuple(seq.token_ids[start:end]) + tuple(seq.spec_token_ids[:s.num_spec_tokens])
        return SeqChunk(tokens, start, tuple(table), s.want_logits, 1 + s.num_spec_tokens)

    def postprocess(self, out: SchedulerOutput, num_rejected: list[int] | None = None) -> None:
        """After the runner wrote the step's KV and the step's tokens were appended: advance progress
        and publish full blocks. `num_rejected[i]`: drafts of scheduled[i] the target rejected; their
        KV slots are given back (the next step overwrites them)."""
        for i, s in enumerate(out.scheduled):
            seq = s.seq
            if seq.is_finished:
                continue
            rejected = num_rejected[i] if num_rejected is not None else 0
            seq.num_computed_tokens = min(seq.num_computed_tokens + s.num_new_tokens - rejected, seq.num_tokens)
            if s.num_spec_tokens:
                self.block_manager.trim(seq, seq.num_tokens)
            self.block_manager.cache_computed_blocks(seq)


class _StepPlan:
    """Scratch state of one schedule() call."""

    __slots__ = ("_ids", "budget", "failed", "preempted", "scheduled")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled: list[ScheduledSeq] = []
        self.preempted: list[Sequence] = []
        self.failed: list[Sequence] = []
        self._ids: set[int] = set()

    def add(self, seq: Sequence, num_new_tokens: int, reaches_end: bool, num_spec_tokens: int = 0) -> None:
        """`reaches_end`: the chunk runs up to seq's last token (sampled, or pooled for an embedding)."""
        pooled = reaches_end and seq.is_embedding
        self.scheduled.append(ScheduledSeq(seq, num_new_tokens, reaches_end and not pooled, num_spec_tokens, pooled))
        self._ids.add(id(seq))
        self.budget -= num_new_tokens

    def is_scheduled(self, seq: Sequence) -> bool:
        return id(seq) in self._ids
