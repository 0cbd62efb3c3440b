"""gateway.routing.load.prefill_work_tokens: the prefill work a lease counts, read-backs from KV tiers included at
their restore fraction."""
from __future__ import annotations

from hypothesis import given, strategies as st

from gateway.routing.load import DEFAULT_RESTORE_FRACTIONS, prefill_work_tokens
from policies.prefix_aware import PrefixAwareConfig


def test_without_tier_blocks_the_work_is_the_tokens_computed() -> None:
    assert prefill_work_tokens((0, 0, 0, 0), 16, 100, (None, None, None)) == 100
    assert prefill_work_tokens((3, 0, 0, 0), 16, 100, (0.1, 0.1, 0.1)) == 52
    assert prefill_work_tokens((7, 0, 0, 0), 16, 100, (None, None, None)) == 0   # the whole prompt held


def test_a_read_back_costs_its_tokens_at_the_mediums_restore_fraction() -> None:
    # 2 device blocks, 1 in RAM, 2 in the store: 32 tokens computed, 16 at 0.05, 32 at 0.25
    assert prefill_work_tokens((2, 1, 0, 2), 16, 112, (0.05, None, 0.25)) == 32 + round(16 * 0.05 + 32 * 0.25)
    # a medium the worker measured nothing for costs the default guess
    assert prefill_work_tokens((0, 0, 4, 0), 16, 64, (None, None, None)) == round(64 * DEFAULT_RESTORE_FRACTIONS[1])


def test_a_partial_last_block_counts_only_its_prompt_tokens() -> None:
    # 40 tokens: 16 on the device, 24 in the store's two blocks (the second holds 8 of them)
    assert prefill_work_tokens((1, 0, 0, 2), 16, 40, (None, None, 0.25)) == round(24 * 0.25)


@given(st.tuples(*(st.integers(0, 8) for _ in range(4))), st.integers(1, 300),
       st.tuples(*(st.one_of(st.none(), st.floats(0.0, 1.0)) for _ in range(3))))
def test_the_work_lies_between_the_tokens_computed_and_the_whole_prompt(matched, num_prompt_tokens,
                                                                        fractions) -> None:
    block = 16
    uncached = max(0, num_prompt_tokens - sum(matched) * block)
    work = prefill_work_tokens(matched, block, num_prompt_tokens, fractions)
    assert uncached <= work <= num_prompt_tokens
    free = prefill_work_tokens(matched, block, num_prompt_tokens, (0.0, 0.0, 0.0))
    full = prefill_work_tokens(matched, block, num_prompt_tokens, (1.0, 1.0, 1.0))
    assert free == uncached   # read back for nothing: only what is computed
    assert full == max(0, num_prompt_tokens - min(num_prompt_tokens, matched[0] * block))   # as dear as computing


def test_the_default_guesses_are_prefix_aware_routings_default_weights_complement() -> None:
    """One guess, two readings: the lease's cost of a read-back and the policy's worth of a tier token add up to a
    computed token."""
    config = PrefixAwareConfig()
    weights = (config.cpu_weight, config.disk_weight, config.store_weight)
    assert [round(f + w, 9) for f, w in zip(DEFAULT_RESTORE_FRACTIONS, weights, strict=True)] == [1.0, 1.0, 1.0]
