"""Scheduler: token budget, decode-first mixed steps, chunked prefill, admission, preemption,
cancellation, oversized sequences, the KV connector (loads, kept blocks), embedding inputs (prefilled,
pooled, never decoded); plus the block-accounting property test."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from backends.core.block_manager import BlockManager
from backends.core.kv_transfer_params import KVTransferParams
from backends.core.outputs import FinishReason
from backends.core.sampling_params import SamplingParams
from backends.core.sequence import Sequence, SequenceStatus
from backends.engine.scheduler import Scheduler, SchedulerOutput
from tests.backends.engine.fake_connector import PREFILL, REMOTE, FakeConnector


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 16,
         max_model_len: int = 1000, watermark: int = 0, connector: FakeConnector | None = None) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_model_len, watermark, connector)


def seq(rid: str, prompt_len: int, max_tokens: int = 4, base: int = 0,
        kv_transfer: KVTransferParams | None = None) -> Sequence:
    return Sequence(rid, tuple(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens),
                    seed=0, kv_transfer=kv_transfer)


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step without a model: every chunk that wants logits gets `token`; an embedding input whose
    last chunk ran finishes."""
    out = s.schedule()
    s.postprocess(out)
    for sch in out.scheduled:
        if sch.want_embedding and not sch.seq.is_finished:
            s.finish(sch.seq, FinishReason.STOP)
        if sch.want_logits and not sch.seq.is_finished:
            assert sch.seq.params is not None, "an embedding input wants no logits"
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


def embedding(rid: str, prompt_len: int, base: int = 0) -> Sequence:
    return Sequence(rid, tuple(range(base, base + prompt_len)), None, seed=0)


def roles(out: SchedulerOutput) -> list[tuple[str, int, bool, bool]]:
    return [(x.seq.request_id, x.num_new_tokens, x.want_logits, x.want_embedding) for x in out.scheduled]


def test_embedding_input_is_prefilled_in_chunks_then_pooled_and_never_decoded() -> None:
    s = make(budget=8)
    s.add(seq("g", 3, max_tokens=10))
    s.add(embedding("e", 13, base=50))
    assert roles(step(s)) == [("g", 3, True, False), ("e", 5, False, False)]
    assert s.num_decode_tokens_pending() == 9          # g's; an embedding decodes nothing
    assert roles(step(s)) == [("g", 1, True, False), ("e", 7, False, False)]
    e = s.get("e")
    out = step(s)                                      # finishes e, as the engine does once it pooled the chunk
    assert roles(out) == [("g", 1, True, False), ("e", 1, False, True)]
    assert not out.batch.chunks[1].want_logits         # the runner computes no logits for it
    assert e is not None and e.is_finished and e.num_computed_tokens == 13 and e.num_output_tokens == 0
    assert roles(step(s)) == [("g", 1, True, False)]
    # g holds two blocks; e's three full blocks stay in the prefix cache, with g's first.
    assert (s.block_manager.num_used_blocks, s.block_manager.num_cached_blocks) == (2, 4)


def test_embedding_input_preempted_mid_prompt_is_recomputed() -> None:
    s = make(num_blocks=3, block_size=4, budget=8)
    s.add(seq("g", 4, max_tokens=3))
    s.add(embedding("e", 8, base=50))
    assert roles(step(s)) == [("g", 4, True, False), ("e", 4, False, False)]
    out = step(s)                                      # g's next token needs a block: e, the newest, goes
    assert [p.request_id for p in out.preempted] == ["e"] and roles(out) == [("g", 1, True, False)]
    while s.get("g") is not None:
        step(s)
    out = step(s)
    assert roles(out)[-1][0] == "e" and roles(out)[-1][2:] == (False, True)
    e = out.scheduled[-1].seq
    assert e.is_finished and e.num_preemptions == 1 and e.num_computed_tokens == 8
    assert s.block_manager.num_used_blocks == 0 and not s.has_unfinished()


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


def test_remote_kv_admission_waits_for_the_load_then_runs_only_the_last_token() -> None:
    c = FakeConnector()
    s = make(budget=100, connector=c)
    s.add(seq("r", 9, kv_transfer=REMOTE))
    out = s.schedule()
    assert out.is_empty and s.num_waiting == 1 and len(s.get("r").block_table) == 3
    assert s.get("r").status is SequenceStatus.WAITING_FOR_REMOTE_KV and list(c.loads) == ["r"]
    assert s.schedule().is_empty   # still loading
    assert c.finish_load("r") and not c.finish_load("r")
    assert plan(step(s)) == [("r", 1, True)]
    assert s.block_manager.num_cached_blocks == 2


def test_a_loaded_sequence_keeps_its_admission_place() -> None:
    """Admitted first, it loads while a later one prefills; once loaded it takes its prefill budget
    first, and preemption still takes the newest admitted."""
    c = FakeConnector()
    s = make(num_blocks=6, budget=4, connector=c)
    s.add(seq("r", 9, max_tokens=8, kv_transfer=REMOTE))
    s.add(seq("b", 12, max_tokens=8, base=50))
    assert plan(step(s)) == [("b", 4, False)]          # r loads into 3 blocks, b prefills in its 3
    assert c.finish_load("r")
    assert plan(step(s)) == [("r", 1, True), ("b", 3, False)]
    assert [x.request_id for x in s.running] == ["r", "b"]
    preempted = []
    while not preempted:                               # no block is free: one must go once both grow
        preempted = [x.request_id for x in step(s).preempted]
    assert preempted == ["b"] and s.get("r").num_preemptions == 0


def test_a_failed_load_fails_the_sequence_and_frees_its_blocks() -> None:
    c = FakeConnector()
    s = make(num_blocks=8, connector=c)
    s.add(seq("r", 9, kv_transfer=REMOTE))
    s.schedule()
    c.finish_load("r", error="peer closed")
    out = s.schedule()
    (failed,) = out.failed
    assert failed.request_id == "r" and failed.error == "peer closed" and failed.finish_reason is FinishReason.ABORT
    assert s.block_manager.num_used_blocks == 0 and not s.has_unfinished()


def test_abort_during_a_load_frees_blocks_only_once_the_load_ends() -> None:
    c = FakeConnector()
    s = make(num_blocks=8, connector=c)
    s.add(seq("r", 9, kv_transfer=REMOTE))
    s.schedule()
    assert s.abort("r") is not None and not s.has_unfinished()
    assert s.block_manager.num_used_blocks == 3   # the load may still write them
    assert s.abort_all("loop failed") == []
    c.finish_load("r")
    assert s.schedule().is_empty and s.block_manager.num_used_blocks == 0


def test_abort_all_spares_sequences_waiting_for_a_load() -> None:
    c = FakeConnector()
    s = make(connector=c)
    s.add(seq("r", 9, kv_transfer=REMOTE))
    s.add(seq("x", 5, base=50))
    s.schedule()
    assert [x.request_id for x in s.abort_all("loop failed")] == ["x"]
    assert s.get("r") is not None and s.get("r").status is SequenceStatus.WAITING_FOR_REMOTE_KV


def test_prefill_leg_keeps_its_blocks_until_the_connector_sent_them() -> None:
    c = FakeConnector()
    s = make(num_blocks=8, connector=c)
    s.add(seq("p", 9, max_tokens=1, kv_transfer=PREFILL))
    step(s)
    assert s.get("p") is None and c.kept["p"] and s.block_manager.num_held_blocks == 3
    assert s.block_manager.num_used_blocks == 3
    assert c.release("p")
    s.schedule()
    assert s.block_manager.num_used_blocks == 0 and s.block_manager.num_held_blocks == 0


def test_prefill_leg_that_stops_or_aborts_keeps_nothing() -> None:
    c = FakeConnector()
    s = make(num_blocks=8, connector=c)
    s.add(seq("p", 9, max_tokens=1, kv_transfer=PREFILL))
    s.add(seq("q", 5, max_tokens=1, base=50, kv_transfer=PREFILL))
    s.finish(s.get("p"), FinishReason.STOP)
    s.abort("q")
    assert not c.kept and s.block_manager.num_used_blocks == 0


# --- property test ---------------------------------------------------------------------------

# (kind selector 0-99, then arguments): weighted so that sequences grow into preemption.
OPS = st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99), st.integers(1, 8), st.integers(1, 8),
                         st.booleans()), min_size=10, max_size=60)
KINDS = ((30, "add"), (75, "step"), (80, "fail_step"), (87, "abort"), (93, "remote_ready"), (100, "release"))


def _check_refs(s: Scheduler, c: FakeConnector) -> None:
    bm = s.block_manager
    bm.check_invariants()
    loading, kept = c.block_owners()
    owners = {id(x): x for x in [*s.running, *s.waiting, *s.waiting_for_remote_kv.values(), *loading]}
    expected: Counter[int] = Counter()
    for x in owners.values():
        expected.update(x.block_table)
    for blocks in kept:
        expected.update(blocks)
    assert all(bm.ref_count(b) == expected[b] for b in range(bm.num_total_blocks))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(4, 12), budget=st.integers(1, 12), caching=st.booleans())
def test_blocks_always_accounted_for(ops: list[tuple], num_blocks: int, budget: int, caching: bool) -> None:
    c = FakeConnector()
    s = Scheduler(BlockManager(num_blocks, 2, caching), 4, budget, 24, watermark_blocks=1, kv_connector=c)
    ids: list[str] = []
    for selector, arg, n, max_tokens, flag in ops:
        kind = next(name for bound, name in KINDS if selector < bound)
        if kind == "add":
            rid = f"r{len(ids)}"
            ids.append(rid)
            # a decode leg loads its prompt's KV; a prefill leg keeps its blocks when it finishes by length; an
            # embedding input is prefilled and ends
            kv = (REMOTE if arg % 3 == 0 else PREFILL) if flag and arg % 3 != 2 else None
            params = None if flag and arg % 3 == 2 else SamplingParams(max_tokens=max_tokens)
            s.add(Sequence(rid, tuple([arg % 3] * n), params, 0, kv_transfer=kv))
        elif kind == "step":
            step(s, token=arg % 3)
        elif kind == "fail_step":       # the runner raised: the step's sequences are failed
            for sch in s.schedule().scheduled:
                s.finish(sch.seq, FinishReason.ABORT, "boom")
        elif kind == "abort" and ids:
            s.abort(ids[arg % len(ids)])
        elif kind == "remote_ready" and ids:
            c.finish_load(ids[arg % len(ids)], "pull failed" if n == 8 else None)
        elif kind == "release" and c.kept:
            c.release(sorted(c.kept)[arg % len(c.kept)])
        _check_refs(s, c)
    for rid in ids:
        s.abort(rid)
    for rid in list(c.loads):
        c.finish_load(rid)
    for rid in list(c.kept):
        c.release(rid)
    s.schedule()
    bm = s.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_used_blocks == 0
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_total_blocks))
    assert not s.has_unfinished()
