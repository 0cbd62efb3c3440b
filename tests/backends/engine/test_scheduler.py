"""Scheduler: token budget, decode-first mixed steps, chunked prefill, admission, preemption,
cancellation, oversized sequences, remote KV admission; plus the block-accounting property test."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.engine.block_manager import BlockManager
from backends.engine.outputs import FinishReason
from backends.engine.sampling_params import SamplingParams
from backends.engine.scheduler import Scheduler, SchedulerOutput
from backends.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 16,
         max_model_len: int = 1000, watermark: int = 0) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_model_len, watermark)


def seq(rid: str, prompt_len: int, max_tokens: int = 4, base: int = 0, remote_kv: bool = False) -> Sequence:
    return Sequence(rid, tuple(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens),
                    seed=0, remote_kv=remote_kv)


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step without a model: every chunk that wants logits gets `token`."""
    out = s.schedule()
    s.postprocess(out)
    for sch in out.scheduled:
        if sch.want_logits and not sch.seq.is_finished:
            sch.seq.append_token(token)
            if sch.seq.num_output_tokens >= sch.seq.params.max_tokens:
                s.finish(sch.seq, FinishReason.LENGTH)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(x.seq.request_id, x.num_new_tokens, x.want_logits) for x in out.scheduled]


def test_chunked_prefill_then_decodes_first_in_mixed_steps() -> None:
    s = make(budget=16)
    for rid, n in (("a", 10), ("b", 10), ("c", 3)):
        s.add(seq(rid, n))
    assert plan(step(s)) == [("a", 10, True), ("b", 6, False)]
    assert plan(step(s)) == [("a", 1, True), ("b", 4, True), ("c", 3, True)]
    out = step(s)
    assert plan(out) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    chunk = out.batch.chunks[0]
    assert chunk.num_context_tokens == 11 and chunk.token_ids == (7,) and len(chunk.block_table) == 3


def test_batch_chunks_name_context_and_blocks() -> None:
    s = make(budget=6)
    s.add(seq("a", 10))
    first, second = s.schedule(), None
    assert first.batch.chunks[0].token_ids == tuple(range(6))
    assert first.batch.chunks[0].block_table == tuple(s.get("a").block_table[:2])
    s.postprocess(first)
    second = s.schedule()
    c = second.batch.chunks[0]
    assert (c.num_context_tokens, c.token_ids, c.want_logits) == (6, tuple(range(6, 10)), True)
    assert len(c.block_table) == 3


def test_max_num_seqs_limits_admission() -> None:
    s = make(max_num_seqs=2, budget=100)
    for rid in "abc":
        s.add(seq(rid, 2))
    assert [x[0] for x in plan(step(s))] == ["a", "b"]
    assert s.num_waiting == 1 and s.num_running == 2


def test_admission_respects_watermark_and_fifo() -> None:
    s = make(num_blocks=4, budget=100, watermark=1)
    s.add(seq("a", 8))          # 2 blocks, admitted alone (no watermark when the engine is empty)
    s.add(seq("b", 5))          # 2 blocks: would leave 0 < watermark
    s.add(seq("c", 1))          # would fit, but FIFO
    assert [x[0] for x in plan(step(s))] == ["a"]
    assert s.num_waiting == 2


def test_preemption_by_recompute_newest_first_and_prefix_reuse() -> None:
    s = make(num_blocks=5, block_size=4, budget=100, max_num_seqs=4)
    s.add(seq("old", 8, max_tokens=6, base=0))
    s.add(seq("new", 8, max_tokens=6, base=100))
    step(s)                     # both prefilled: 2 blocks each, 1 free
    out = step(s)               # both need a third block for position 8: "new" (newest) goes
    assert [p.request_id for p in out.preempted] == ["new"]
    assert plan(out) == [("old", 1, True)]
    new = s.get("new")
    assert new.status is SequenceStatus.WAITING and s.waiting[0] is new and new.block_table == []
    assert new.num_output_tokens == 1 and new.num_preemptions == 1 and s.num_preemptions == 1
    while s.get("old") is not None:   # "old" grows into new's cached blocks, evicting the tail one
        out = step(s)
        assert "new" not in [x[0] for x in plan(out)]
    out = step(s)               # readmitted: recomputes prompt + generated token, first block cached
    assert plan(out) == [("new", 5, True)]
    assert out.batch.chunks[0].num_context_tokens == 4 and new.num_cached_tokens == 0
    while s.has_unfinished():
        step(s)
    assert new.num_output_tokens == 6
    assert s.block_manager.num_free_blocks == 5


def test_abort_frees_blocks_at_once_and_is_idempotent() -> None:
    s = make(num_blocks=8)
    s.add(seq("a", 9))
    step(s)
    assert s.block_manager.num_used_blocks == 3
    aborted = s.abort("a")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert s.block_manager.num_used_blocks == 0 and s.abort("a") is None
    s.add(seq("w", 3))
    assert s.abort("w") is not None and s.num_waiting == 0


def test_sequence_that_can_never_fit_fails_instead_of_looping() -> None:
    s = make(num_blocks=2, block_size=4, budget=100)
    s.add(seq("big", 9))        # 3 blocks > 2
    out = s.schedule()
    assert [f.request_id for f in out.failed] == ["big"] and out.is_empty
    assert "KV blocks" in (out.failed[0].error or "")
    s.add(seq("grow", 7, max_tokens=10))
    for _ in range(3):
        out = step(s)
    assert [f.request_id for f in out.failed] == ["grow"] and not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 2


@pytest.mark.parametrize("prompt_len", [0, 1001])
def test_prompt_outside_context_rejected_before_admission(prompt_len: int) -> None:
    s = make()
    with pytest.raises(ValueError):
        s.add(seq("x", prompt_len))
    assert not s.has_unfinished()


def test_duplicate_request_id_rejected() -> None:
    s = make()
    s.add(seq("x", 2))
    with pytest.raises(ValueError, match="duplicate"):
        s.add(seq("x", 2))


def test_remote_kv_admission_runs_only_the_last_token() -> None:
    s = make(budget=100)
    s.add(seq("r", 9, remote_kv=True))
    out = s.schedule()
    assert out.is_empty and s.num_waiting == 1 and len(s.get("r").block_table) == 3
    assert s.remote_kv_ready("r", 9) and not s.remote_kv_ready("r", 9)
    assert plan(step(s)) == [("r", 1, True)]
    assert s.block_manager.num_cached_blocks == 2


def test_finish_with_hold_keeps_blocks_until_release() -> None:
    s = make(num_blocks=8)
    s.add(seq("p", 9, max_tokens=1))
    out = s.schedule()
    s.postprocess(out)
    handle = s.finish(s.get("p"), FinishReason.LENGTH, hold_blocks=True)
    assert handle is not None and s.block_manager.num_used_blocks == 3
    assert s.block_manager.release(handle) and s.block_manager.num_used_blocks == 0


# --- property test ---------------------------------------------------------------------------

# (kind selector 0-99, then arguments): weighted so that sequences grow into preemption.
OPS = st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99), st.integers(1, 8), st.integers(1, 8),
                         st.booleans()), min_size=10, max_size=60)
KINDS = ((30, "add"), (75, "step"), (80, "fail_step"), (87, "abort"), (93, "remote_ready"), (100, "release"))


def _check_refs(s: Scheduler, handles: list[int]) -> None:
    bm = s.block_manager
    bm.check_invariants()
    live = [x for x in list(s.running) + list(s.waiting) + list(s.awaiting_kv.values())]
    expected: Counter[int] = Counter()
    for x in live:
        expected.update(x.block_table)
    for h in handles:
        expected.update(bm.held_blocks(h) or ())
    assert all(bm.ref_count(b) == expected[b] for b in range(bm.num_total_blocks))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(4, 12), budget=st.integers(1, 12), caching=st.booleans())
def test_blocks_always_accounted_for(ops: list[tuple], num_blocks: int, budget: int, caching: bool) -> None:
    s = Scheduler(BlockManager(num_blocks, 2, caching), 4, budget, 24, watermark_blocks=1)
    handles: list[int] = []
    ids: list[str] = []
    for selector, arg, n, max_tokens, flag in ops:
        kind = next(name for bound, name in KINDS if selector < bound)
        if kind == "add":
            rid = f"r{len(ids)}"
            ids.append(rid)
            s.add(Sequence(rid, tuple([arg % 3] * n), SamplingParams(max_tokens=max_tokens), 0,
                           remote_kv=flag and arg % 3 == 0))
        elif kind == "step":
            out = step(s, token=arg % 3)
            live = [x.seq for x in out.scheduled if not x.seq.is_finished]
            if live and flag and arg % 4 == 0:     # a disaggregated prefill pins its blocks
                handles.append(s.finish(live[0], FinishReason.LENGTH, hold_blocks=True))
        elif kind == "fail_step":       # the runner raised: the step's sequences are failed
            for sch in s.schedule().scheduled:
                s.finish(sch.seq, FinishReason.ABORT, "boom")
        elif kind == "abort" and ids:
            s.abort(ids[arg % len(ids)])
        elif kind == "remote_ready" and ids:
            s.remote_kv_ready(ids[arg % len(ids)], n)
        elif kind == "release" and handles:
            s.block_manager.release(handles.pop(arg % len(handles)))
        _check_refs(s, handles)
    for rid in ids:
        s.abort(rid)
    for h in handles:
        s.block_manager.release(h)
    bm = s.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_used_blocks == 0
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_total_blocks))
    assert not s.has_unfinished()
