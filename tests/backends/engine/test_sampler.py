"""Sampler: each knob against transformers' logits processors or the documented formula,
on synthetic logits; seeded rows do not depend on the batch around them."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from backends.core.sampling_params import SamplingParams
from backends.worker.sampler import (
    SampleRow,
    add_logit_bias,
    apply_penalties,
    filtered_probs,
    greedy_tokens,
    sample,
    step_seed,
    step_uniform,
)
from tests.backends.numerics import choice

V = 12
EOS = (2,)


def row(seed: int = 0, prompt: tuple[int, ...] = (), output: tuple[int, ...] = (), **kw: object) -> SampleRow:
    return SampleRow(SamplingParams(**kw), seed, prompt, output, EOS)


def rand_logits(n: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_ignores_seed() -> None:
    logits = rand_logits(5)
    out = sample(logits, [row(seed=i, temperature=0.0) for i in range(5)])
    assert list(out.token_ids) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    logits = rand_logits(4)
    rows = [row(prompt=(1, 4), output=(4, 7), repetition_penalty=penalty),
            row(prompt=(0,), output=(), repetition_penalty=penalty),
            row(prompt=(3, 5, 9), output=(11, 11), repetition_penalty=1.0),
            row(prompt=(9, 0, 9, 0, 5, 5, 5, 1), output=(0,), repetition_penalty=penalty)]
    got = apply_penalties(logits.clone(), rows)
    for i, r in enumerate(rows):
        ids = torch.tensor([list(r.prompt_token_ids) + list(r.output_token_ids)])
        ref = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], ref)


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    logits = rand_logits(4)
    rows = [row(prompt=(5, 5, 5), output=(1, 1, 1, 3), presence_penalty=0.5, frequency_penalty=0.25),
            row(output=(0,), presence_penalty=-1.0),
            row(prompt=(0,), output=(), presence_penalty=0.7, frequency_penalty=0.1),
            row(output=(7, 0, 7, 0, 0, 2), presence_penalty=0.2, frequency_penalty=0.3)]
    got = apply_penalties(logits.clone(), rows)
    ref = logits.clone()
    for i, r in enumerate(rows):
        for tok in set(r.output_token_ids):      # prompt tokens are not penalized
            count = r.output_token_ids.count(tok)
            ref[i, tok] -= count * r.params.frequency_penalty + r.params.presence_penalty
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("temperature", [1e-300, 1e-30, 1e-6])
def test_a_temperature_below_float32s_reach_samples_greedily(temperature: float) -> None:
    """1e-300 is 0 in float32: dividing by it gave NaN probabilities, and the inverse CDF a token the logits
    rank nowhere (a real worker answered "ectable" a dozen times, at logprob -25). The limit is greedy."""
    logits = rand_logits(6, vocab=5000, seed=3)
    rows = [row(seed=i, temperature=temperature) for i in range(6)]
    assert rows[0].params.greedy and not SamplingParams(temperature=1e-5).greedy
    assert list(sample(logits, rows).token_ids) == logits.argmax(-1).tolist()


def test_a_penalty_that_overflows_a_logit_samples_among_the_overflowing_tokens() -> None:
    """repetition_penalty 1e-40 divides the seen tokens' positive logits past float32's range (+inf, then NaN
    probabilities). Those tokens share the mass instead, as the penalty's limit says; no other is drawn."""
    logits = rand_logits(1, vocab=5000, seed=4).clamp(max=1.0)
    logits[0, 3], logits[0, 7], logits[0, 9] = 2.0, 1.5, -1.0      # seen: 3 and 7 overflow; 9 goes to -0
    rows = [row(seed=i, prompt=(3, 9), output=(7,), temperature=1.0, repetition_penalty=1e-40) for i in range(64)]
    probs = filtered_probs(apply_penalties(logits.expand(64, -1).clone(), rows), rows)
    assert not probs.isnan().any()
    torch.testing.assert_close(probs[0, [3, 7]], torch.tensor([0.5, 0.5]))
    drawn = {t for i in range(64) for t in sample(logits.clone(), [rows[i]]).token_ids}
    assert drawn == {3, 7}


def test_logit_bias_then_repetition_penalty_match_transformers() -> None:
    """logit_bias is added before the penalties, as transformers' sequence_bias (one-token sequences) and
    vLLM order them. Row 0 is built so that the order decides the token: token 3 (seen, logit 2, bias +2,
    penalty 2) scores 2 biased first, against 3 penalized first, and the unseen token 5 scores 2.5."""
    logits = rand_logits(4)
    logits[0] = -5.0
    logits[0, 3], logits[0, 5] = 2.0, 2.5
    rows = [row(prompt=(3,), temperature=0.0, repetition_penalty=2.0, logit_bias=((3, 2.0),)),
            row(prompt=(1, 4), output=(4,), temperature=0.0, repetition_penalty=1.3,
                logit_bias=((4, 3.5), (7, -100.0), (0, 1.25))),
            row(output=(9, 9), temperature=0.0, logit_bias=((11, 100.0),)),
            row(temperature=0.0)]
    got = sample(logits.clone(), rows).token_ids
    for i, r in enumerate(rows):
        ids = torch.tensor([list(r.prompt_token_ids) + list(r.output_token_ids) or [0]])
        ref = logits[i:i + 1].clone()
        if r.params.logit_bias:
            ref = SequenceBiasLogitsProcessor({(t,): b for t, b in r.params.logit_bias})(ids, ref)
        if r.params.repetition_penalty != 1.0:
            ref = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(ids, ref)
        assert got[i] == int(ref.argmax()), (i, got[i], ref)
    assert got[0] == 5 and got[2] == 11
    # The biased logits themselves, and the caller's tensor untouched.
    before = logits.clone()
    biased = add_logit_bias(logits, rows)
    assert torch.equal(logits, before)
    want = logits.clone()
    want[0, 3] += 2.0
    want[1, 4] += 3.5
    want[1, 7] -= 100.0
    want[1, 0] += 1.25
    want[2, 11] += 100.0
    torch.testing.assert_close(biased, want)


@pytest.mark.parametrize("kw", [
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.3, "top_p": 0.6},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "min_p": 0.1},
    {"temperature": 5.0, "top_p": 0.99},           # flat: the nucleus spans beyond the candidates
    {"temperature": 1.0, "top_k": 700, "top_p": 0.9},
])
@pytest.mark.parametrize("vocab", [V, 5000])
def test_filtered_probs_match_transformers_warpers(kw: dict, vocab: int) -> None:
    logits = rand_logits(4, vocab=vocab, seed=1)
    params = SamplingParams(**kw)
    got = filtered_probs(logits.clone(), [SampleRow(params, 0, (), (), EOS)] * 4)
    ref = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k > 0:
        ref = TopKLogitsWarper(params.top_k)(None, ref)
    if params.top_p < 1.0:
        ref = TopPLogitsWarper(params.top_p)(None, ref)
    if params.min_p > 0.0:
        ref = MinPLogitsWarper(params.min_p)(None, ref)
    torch.testing.assert_close(got, ref.softmax(-1), atol=1e-6, rtol=1e-5)


def test_sampled_frequencies_match_the_distribution() -> None:
    """2000 seeds of one distribution: support respected, frequencies within 4 sigma."""
    logits = rand_logits(1, seed=2).repeat(2000, 1)
    params = dict(temperature=0.8, top_k=6)
    rows = [row(seed=s, **params) for s in range(2000)]
    probs = filtered_probs(logits[:1].clone(), rows[:1])[0]
    tokens = torch.tensor(sample(logits, rows).token_ids)
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[probs == 0].sum() == 0
    sigma = (2000 * probs * (1 - probs)).sqrt()
    assert ((counts - 2000 * probs).abs() <= 4 * sigma + 1).all(), (counts, 2000 * probs)


def test_min_tokens_masks_eos_and_stop_ids_then_releases() -> None:
    logits = torch.full((2, V), -5.0)
    logits[:, 2] = 10.0                   # EOS is by far the best
    logits[:, 7] = 9.0                    # then a stop id
    logits[:, 4] = 1.0
    early = row(output=(4,), temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    late = row(output=(4, 4), temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    assert sample(logits, [early, late]).token_ids == (4, 2)


def test_ignore_eos_masks_eos_but_not_stop_ids() -> None:
    logits = torch.full((1, V), -5.0)
    logits[0, 2], logits[0, 7] = 10.0, 9.0
    assert sample(logits, [row(temperature=0.0, ignore_eos=True, stop_token_ids=(7,))]).token_ids == (7,)


def test_logprobs_come_from_raw_logits_before_penalties_and_temperature() -> None:
    logits = rand_logits(3, seed=3)
    rows = [row(seed=1, temperature=0.5, repetition_penalty=2.0, prompt=(1, 2), logprobs=3),
            row(temperature=0.0),
            row(seed=2, temperature=0.0, logprobs=0)]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == out.token_ids[0]
    assert math.isclose(lp.logprob, raw[0, lp.token_id].item(), rel_tol=1e-6)
    top_vals, top_ids = raw[0].topk(3)
    assert [t for t, _ in lp.top] == top_ids.tolist()
    assert all(math.isclose(v, r, rel_tol=1e-6) for (_, v), r in zip(lp.top, top_vals.tolist(), strict=True))
    assert out.logprobs[2] is not None and out.logprobs[2].top == ()


def test_seeded_rows_identical_alone_and_in_any_batch() -> None:
    target = row(seed=1234, output=(1, 5, 5), temperature=0.9, top_p=0.9, frequency_penalty=0.3)
    logits = rand_logits(1, vocab=500, seed=4)
    alone = [sample(logits, [SampleRow(target.params, target.seed, (), tuple(range(k)), EOS)]).token_ids[0]
             for k in range(30)]
    others = rand_logits(6, vocab=500, seed=5)
    for k in range(30):
        target_k = SampleRow(target.params, target.seed, (), tuple(range(k)), EOS)
        neighbours = [row(seed=k, temperature=0.5), row(temperature=0.0, repetition_penalty=1.2, prompt=(3,)),
                      row(seed=9, top_k=4, min_p=0.1, logprobs=2)]
        batch = torch.cat([others[:2], logits, others[2:3]])
        got = sample(batch, [neighbours[0], neighbours[1], target_k, neighbours[2]]).token_ids[2]
        # exact: the same logits row; every sampler op works row by row, over 256 candidates in both
        # batches, on rows too small (500) for PyTorch to split one across threads
        assert got == alone[k]
    assert len(set(alone)) > 3            # the step index really changes the draw


def test_step_seed_mixes_seed_and_step() -> None:
    seeds = {step_seed(s, k) for s in range(50) for k in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**63 for x in seeds)
    draws = [step_uniform(s, 0) for s in range(4000)]
    assert all(0.0 <= u < 1.0 for u in draws) and abs(sum(draws) / 4000 - 0.5) < 0.02


def test_mixed_batch_filters_each_row_by_its_own_knobs() -> None:
    logits = rand_logits(3, vocab=2000, seed=6)
    rows = [row(temperature=1.0), row(temperature=1.0, top_k=2), row(temperature=3.0, top_p=0.97)]
    got = filtered_probs(logits.clone(), rows)
    torch.testing.assert_close(got[0], logits[0].softmax(-1))
    assert (got[1] > 0).sum() == 2
    ref = TopPLogitsWarper(0.97)(None, logits[2:3] / 3.0).softmax(-1)[0]
    torch.testing.assert_close(got[2], ref, atol=1e-6, rtol=1e-5)


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, V), [row()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_matches_cpu() -> None:
    """The draw comes from (seed, step) alone, so a step may run on either device."""
    logits = rand_logits(16, vocab=4000, seed=7)
    rows = [row(seed=i, output=tuple(range(i)), temperature=0.8, top_p=0.9, top_k=100 if i % 2 else 0,
                repetition_penalty=1.1, prompt=(1, 2, 3), logprobs=2 if i % 3 == 0 else None) for i in range(16)]
    rows[0] = row(temperature=0.0)
    cpu, gpu = sample(logits, rows), sample(logits.cuda(), rows)
    # The devices sum over the vocabulary (softmax, logsumexp, cumsum) in different orders: each sum of
    # V float32 terms lies within V * 2^-24 of exact (relative), which moving every logit by
    # T * V * 2^-24 covers. Equal draws are required where that cannot change the draw: nearly everywhere.
    clear = []
    for i, r in enumerate(rows):
        tolerance = max(r.params.temperature, 1.0) * logits.shape[1] * 2.0 ** -24
        c = choice(logits[i], r.params, r.seed, r.prompt_token_ids, r.output_token_ids, EOS, tolerance)
        assert cpu.token_ids[i] == c.token_id
        if c.clear:
            assert gpu.token_ids[i] == cpu.token_ids[i], i
        clear.append(c.clear)
    assert sum(clear) >= 0.8 * len(clear), clear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_argmax_with_ties_infinities_and_nan(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randint(0, 4, (40, 4099), generator=g).to(dtype)   # many ties per row
    logits[3, 11], logits[4, :] = float("nan"), float("-inf")
    logits[5, 100], logits[5, 50] = float("inf"), float("inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[3] == 11 and greedy_tokens(logits)[5] == 50
