"""How a pipeline splits a model and a step: the stages' layers (PipelineStage) and the micro-batches a step's
batch is cut into (micro_batches), checked for any batch hypothesis draws."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from backends.core.batch import ForwardBatch, SeqChunk
from backends.executor.pipeline import micro_batches
from backends.models.pipeline import PipelineStage


@pytest.mark.parametrize(("layers", "stages", "want"), [
    (30, 2, [(0, 15), (15, 30)]),
    (7, 3, [(0, 2), (2, 4), (4, 7)]),   # the later stages take the extra layers (stage 0 holds the LM head)
    (2, 2, [(0, 1), (1, 2)]),
])
def test_stages_hold_contiguous_layers_that_cover_the_model(layers: int, stages: int,
                                                            want: list[tuple[int, int]]) -> None:
    split = [PipelineStage.of(layers, index, stages) for index in range(stages)]
    assert [(s.first_layer, s.stop_layer) for s in split] == want
    assert split[0].is_first and split[-1].is_last and not split[0].is_last


def test_more_stages_than_layers_are_refused() -> None:
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 is more than the model's 2 layers"):
        PipelineStage.of(2, 0, 3)


def test_a_stage_reads_its_layers_and_stage_0_the_embedding_and_head() -> None:
    first, last = PipelineStage.of(4, 0, 2), PipelineStage.of(4, 1, 2)
    assert first.holds("model.layers.1.mlp.down_proj.weight") and not last.holds("model.layers.1.mlp.down_proj.weight")
    assert last.holds("model.layers.3.self_attn.q_proj.weight")
    assert first.holds("model.embed_tokens.weight") and first.holds("lm_head.weight")
    assert not last.holds("model.embed_tokens.weight") and not last.holds("lm_head.weight")
    assert first.holds("model.norm.weight") and last.holds("model.norm.weight")


@st.composite
def batches(draw: st.DrawFn) -> ForwardBatch:
    chunks = []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 40))
        context = draw(st.integers(0, 30))
        want = draw(st.booleans())
        logits = draw(st.integers(1, length)) if want else 1
        tokens = tuple(draw(st.lists(st.integers(0, 999), min_size=length, max_size=length)))
        chunks.append(SeqChunk(tokens, context, (0, 1, 2, 3, 4), want_logits=want, num_logits=logits))
    return ForwardBatch(tuple(chunks))


def _flat(batch: ForwardBatch) -> list[tuple[int, int, int]]:
    """(sequence, position, token) of every token, and (sequence, position) of every logits row."""
    return [(i, c.num_context_tokens + j, t) for i, c in enumerate(batch.chunks) for j, t in enumerate(c.token_ids)]


def _logits_rows(batch: ForwardBatch) -> list[int]:
    """The positions whose logits the batch wants, in order."""
    return [c.num_context_tokens + len(c.token_ids) - k for c in batch.chunks if c.want_logits
            for k in range(c.num_logits, 0, -1)]


@given(batches(), st.integers(1, 4))
def test_micro_batches_run_the_same_tokens_and_logits_in_order(batch: ForwardBatch, count: int) -> None:
    parts = micro_batches(batch, count)
    assert 1 <= len(parts) <= count and all(part.chunks for part in parts)
    # every token at its position, in order, once; a cut chunk's pieces follow each other
    pieces = [c for part in parts for c in part.chunks]
    flat = [(c.num_context_tokens + j, t) for c in pieces for j, t in enumerate(c.token_ids)]
    assert flat == [(pos, t) for _, pos, t in _flat(batch)]
    assert all(c.block_table == (0, 1, 2, 3, 4) for c in pieces)
    assert [r for part in parts for r in _logits_rows(part)] == _logits_rows(batch)


def test_a_long_prefill_is_cut_into_even_parts() -> None:
    prompt = SeqChunk(tuple(range(100)), 0, (0,) * 7)
    parts = micro_batches(ForwardBatch((prompt,)), 2)
    assert [p.num_tokens for p in parts] == [50, 50]
    assert parts[0].chunks[0].want_logits is False and parts[1].chunks[0].num_context_tokens == 50


def test_decodes_split_at_sequence_boundaries() -> None:
    decodes = ForwardBatch(tuple(SeqChunk((i,), 10, (0,)) for i in range(5)))
    assert [p.num_tokens for p in micro_batches(decodes, 2)] == [2, 3]
    assert [p.num_tokens for p in micro_batches(ForwardBatch(decodes.chunks[:1]), 2)] == [1]
