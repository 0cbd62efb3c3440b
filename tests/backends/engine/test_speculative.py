"""Speculative decoding in the engine, on the real bundled model: with drafts the engine produces the
tokens plain decoding produces (greedy and seeded), judged against transformers' logits where float32
rounding cannot decide; max_tokens and EOS inside an accepted run, logprobs, a prefill chunk in the
same step, the slots of rejected drafts given back. The sampling-distribution claim is checked
exactly on a small vocabulary (a chi-square over many seeds). These runs draft K tokens every step
(adaptive K off): the adaptive policy prices drafts by the engine's wall-clock step times, so what it
drafts depends on the machine's load; its own tests below give it fixed costs."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from backends.core.sampling_params import SamplingParams
from backends.core.spec_state import SpecState
from backends.speculative.adaptive import SpecPolicy, StepCost
from backends.speculative.ngram import NgramProposer
from backends.speculative.proposer import DraftRequest
from backends.worker.model_runner import ModelRunner
from backends.worker.sampler import SampleRow, verify
from tests.backends.engine.test_engine_model import make_engine, run_all, tokens
from tests.backends.numerics import (
    assert_mostly_clear,
    assert_same_tokens,
    choices,
    logit_tolerance,
    teacher_forced_logits,
)

STRUCTURED = [
    'Rewrite this JSON with "age" set to 31. Output only the JSON.\n'
    '{"name": "Alice Smith", "age": 30, "email": "alice@example.com", "city": "Springfield", '
    '"tags": ["admin", "editor"]}\n',
    "Refactor: rename the variable x to total.\n"
    "def add_all(values):\n    x = 0\n    for v in values:\n        x = x + v\n    return x\n\n"
    "def add_all(values):\n",
    "Quote the passage exactly. Passage: The quick brown fox jumps over the lazy dog while the "
    "farmer watches from the porch.\nQuote: The quick brown fox",
]


@pytest.fixture(scope="module")
def tokenize(smollm2_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    return lambda text: tok(text)["input_ids"]


def greedy_reference(hf, hf64, prompts: Sequence[list[int]], outputs: Sequence[list[int]], eos, params):
    tolerance = logit_tolerance(hf, hf64, [p + o for p, o in zip(prompts, outputs, strict=True)])
    refs = [choices(teacher_forced_logits(hf, p, o), params, params.seed, eos, tolerance, p)
            for p, o in zip(prompts, outputs, strict=True)]
    assert_mostly_clear(refs, "the plain run's tokens")
    return refs, tolerance


def run_pair(runner: ModelRunner, model_dir: Path, prompts: dict[str, list[int]], params: dict[str, SamplingParams],
             num_blocks: int = 96, **spec: object):
    """The same requests, all at once, through a plain engine and a speculative one."""
    plain, _ = make_engine(runner, model_dir, num_blocks)
    fast, view = make_engine(runner, model_dir, num_blocks, **spec)
    for engine in (plain, fast):
        for rid, p in prompts.items():
            engine.add_request(rid, p, params[rid])
    return plain, run_all(plain), fast, run_all_checked(fast), view


def run_all_checked(engine, max_steps: int = 500) -> dict[str, list]:
    """run_all, checking after every step that no running sequence keeps blocks past its tokens
    (rejected drafts' slots are given back at once)."""
    bm = engine.block_manager
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            bm.check_invariants()
            assert bm.num_free_blocks == bm.num_total_blocks, "blocks leaked"
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        for seq in engine.scheduler.running:
            if not seq.is_prefilling:
                assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens), seq.request_id
    raise AssertionError("engine did not finish")


def test_ngram_greedy_equals_plain_decoding_concurrently(smollm2_runner, smollm2_dir, hf_smollm2, hf_smollm2_f64,
                                                        tokenize) -> None:
    prompts = {f"s{i}": tokenize(text) for i, text in enumerate(STRUCTURED)}
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    plain, want, fast, got, view = run_pair(smollm2_runner, smollm2_dir, prompts, dict.fromkeys(prompts, greedy),
                                            speculative="ngram", num_speculative_tokens=5,
                                            spec_adaptive=False)
    refs, _ = greedy_reference(hf_smollm2, hf_smollm2_f64, list(prompts.values()),
                               [tokens(want[r]) for r in prompts], plain.eos_token_ids, greedy)
    for rid, ref in zip(prompts, refs, strict=True):
        assert_same_tokens(tokens(got[rid]), tokens(want[rid]), ref, rid)
    stats = fast.stats()
    assert stats.speculative == "ngram" and stats.num_spec_accepted_tokens > 0, stats
    assert stats.num_steps < plain.stats().num_steps, (stats.num_steps, plain.stats().num_steps)
    assert any(c.num_logits > 1 for batch, _ in view.steps for c in batch.chunks), "no step verified drafts"


def test_max_tokens_and_eos_inside_an_accepted_run(smollm2_runner, smollm2_dir, hf_smollm2, hf_smollm2_f64,
                                                  tokenize) -> None:
    prompt = tokenize(STRUCTURED[2])
    full = SamplingParams(max_tokens=40, temperature=0.0)
    plain, want, _, got, _ = run_pair(smollm2_runner, smollm2_dir, {"full": prompt}, {"full": full},
                                      speculative="ngram", num_speculative_tokens=4, spec_adaptive=False)
    reference = tokens(want["full"])
    refs, _ = greedy_reference(hf_smollm2, hf_smollm2_f64, [prompt], [reference], plain.eos_token_ids, full)
    assert_same_tokens(tokens(got["full"]), reference, refs[0], "full")
    if reference[-1] in plain.eos_token_ids:
        assert got["full"][-1].finish_reason.value == "stop"
    # max_tokens that end inside a step's accepted run: after the first token of each multi-token output.
    cuts, done = [], 0
    for o in got["full"]:
        if len(o.new_token_ids) > 1:
            cuts.append(done + 1)
        done += len(o.new_token_ids)
    assert cuts, "no step accepted a draft"
    engine, _ = make_engine(smollm2_runner, smollm2_dir, 96, speculative="ngram", num_speculative_tokens=4,
                            spec_adaptive=False)
    for n in cuts[:6]:
        engine.add_request(f"m{n}", prompt, SamplingParams(max_tokens=n, temperature=0.0))
    outs = run_all_checked(engine)
    for n in cuts[:6]:
        out = tokens(outs[f"m{n}"])
        assert len(out) == n, (n, out)
        assert_same_tokens(out, reference[:n], refs[0], f"max_tokens={n}")
        assert outs[f"m{n}"][-1].finish_reason.value == "length"


def test_seeded_sampling_and_logprobs_equal_plain_decoding(smollm2_runner, smollm2_dir, hf_smollm2, hf_smollm2_f64,
                                                           tokenize) -> None:
    prompt = tokenize(STRUCTURED[0])
    params = SamplingParams(max_tokens=32, temperature=0.7, seed=77, logprobs=3, ignore_eos=True)
    plain, want, fast, got, _ = run_pair(smollm2_runner, smollm2_dir, {"r": prompt}, {"r": params},
                                         speculative="ngram", num_speculative_tokens=4, spec_adaptive=False)
    reference = tokens(want["r"])
    refs, tolerance = greedy_reference(hf_smollm2, hf_smollm2_f64, [prompt], [reference], plain.eos_token_ids,
                                       params)
    whole = assert_same_tokens(tokens(got["r"]), reference, refs[0], "seeded with drafts")
    assert fast.stats().num_spec_proposed_tokens > 0
    plain_lps = [lp for o in want["r"] for lp in o.logprobs]
    spec_lps = [lp for o in got["r"] for lp in o.logprobs]
    upto = len(spec_lps) if whole else next(i for i, c in enumerate(refs[0]) if not c.clear)
    assert upto > 0
    for i, (a, b) in enumerate(zip(spec_lps[:upto], plain_lps[:upto], strict=True)):
        assert a.token_id == b.token_id and len(a.top) == len(b.top) == 3, i
        # A log-softmax moves by at most twice the largest logit error.
        assert abs(a.logprob - b.logprob) <= 2 * tolerance, (i, a.logprob, b.logprob)
        for (_, va), (_, vb) in zip(a.top, b.top, strict=True):
            assert abs(va - vb) <= 2 * tolerance, i


def test_drafts_share_a_step_with_a_prefill_chunk(smollm2_runner, smollm2_dir, tokenize) -> None:
    engine, view = make_engine(smollm2_runner, smollm2_dir, 96, speculative="ngram", num_speculative_tokens=4,
                               max_num_batched_tokens=24, spec_adaptive=False)
    engine.add_request("d", tokenize(STRUCTURED[2]), SamplingParams(max_tokens=24, temperature=0.0))
    for _ in range(4):      # its prefill, then decoding with drafts
        engine.step()
    engine.add_request("p", tokenize(STRUCTURED[1]) * 2, SamplingParams(max_tokens=4, temperature=0.0))
    outs = run_all_checked(engine)
    mixed = [batch for batch, _ in view.steps
             if any(c.num_logits > 1 for c in batch.chunks) and any(not c.want_logits for c in batch.chunks)]
    assert mixed, "no step held both a draft verification and a prefill chunk"
    assert sum(len(c.token_ids) for c in mixed[0].chunks) <= 24
    assert len(tokens(outs["p"])) == 4


def test_a_request_can_turn_speculation_off(smollm2_runner, smollm2_dir, tokenize) -> None:
    engine, view = make_engine(smollm2_runner, smollm2_dir, 96, speculative="ngram")
    engine.add_request("off", tokenize(STRUCTURED[2]), SamplingParams(max_tokens=16, temperature=0.0,
                                                                      speculative=False))
    run_all_checked(engine)
    assert engine.stats().num_spec_proposed_tokens == 0
    assert all(c.num_logits == 1 for batch, _ in view.steps for c in batch.chunks)


def test_a_failing_proposer_costs_no_request(smollm2_runner, smollm2_dir, tokenize) -> None:
    class Broken(NgramProposer):
        def propose(self, requests):
            raise RuntimeError("proposer fault")

    engine, _ = make_engine(smollm2_runner, smollm2_dir, 96)
    engine.proposer, engine.spec_policy = Broken(), SpecPolicy(4, 0.0)
    engine.add_request("r", tokenize(STRUCTURED[2]), SamplingParams(max_tokens=8, temperature=0.0))
    outs = run_all_checked(engine)
    assert len(tokens(outs["r"])) == 8 and outs["r"][-1].error is None


# --- the sampling distribution, exactly, on a small vocabulary ---------------------------------------

CHI2_CRITICAL_DF5_P001 = 20.52   # chi-square quantile: 5 degrees of freedom, p = 0.001


def chi_square(counts: list[int], probs: torch.Tensor) -> float:
    n = sum(counts)
    expected = probs.double() * n
    observed = torch.tensor(counts, dtype=torch.float64)
    return float(((observed - expected) ** 2 / expected).sum())


def test_verification_preserves_the_target_distribution() -> None:
    """Two positions over 6 tokens, drafts [2, 4]: the first token emitted must follow p0, and the
    token after an accepted draft p1 (rejection sampling against a one-hot draft). The seeds are
    fixed, so the outcome is deterministic; a sampler that skewed the law fails it."""
    p0 = torch.tensor([0.05, 0.15, 0.30, 0.10, 0.25, 0.15])
    p1 = torch.tensor([0.20, 0.10, 0.05, 0.25, 0.30, 0.10])
    logits = torch.stack([p0.log(), p1.log()])
    params = SamplingParams(max_tokens=8, temperature=1.0)
    draws = 6000
    rows = [SampleRow(params, seed, (0,), (), ()) for seed in range(draws)]
    first = [0] * 6
    second = [0] * 6
    for v in verify(logits.repeat(draws, 1), rows, [[2]] * draws):    # one sequence per seed, in one batch
        first[v.token_ids[0]] += 1
        if v.num_accepted == 1:
            second[v.token_ids[1]] += 1
    assert chi_square(first, p0) < CHI2_CRITICAL_DF5_P001, first
    assert chi_square(second, p1) < CHI2_CRITICAL_DF5_P001, second
    assert abs(first[2] / draws - 0.30) < 0.03      # the draft is accepted with the target's probability of it
    # A skewed law is caught: counts from a distribution that favours the draft fail the same test.
    skewed = p0.clone()
    skewed[2] += 0.05
    skewed[0] -= 0.05
    assert chi_square([round(float(x) * draws) for x in skewed], p0) > CHI2_CRITICAL_DF5_P001


# --- proposers and the adaptive K, without the model ------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match() -> None:
    ngram = NgramProposer(min_n=2, max_n=3)
    seq = [5, 6, 7, 8, 9, 1, 5, 6, 7, 3, 4, 5, 6]
    # Last 3 tokens (4, 5, 6) never occurred before; (5, 6) last occurred at 6-7, followed by 7, 3, 4.
    assert ngram.propose([DraftRequest("a", seq, 3)]) == [[7, 3, 4]]
    assert ngram.propose([DraftRequest("b", [1, 2, 3, 4], 3)]) == [[]]
    grown = [*seq, 7]                      # (5, 6, 7) now matches at 6-8, followed by 3, 4, 5
    assert ngram.propose([DraftRequest("a", grown, 5)]) == [[3, 4, 5, 6, 7]]
    ngram.free("a")
    ngram.free("a")                        # idempotent
    assert ngram.propose([DraftRequest("a", [1, 2, 1], 2)]) == [[]]


# A 2-core CPU's step, by the engine's own fit: 30 ms of weight reading, 1.2 ms a row.
FIXED, ROW = 0.030, 0.0012


def test_k_follows_acceptance_at_batch_1() -> None:
    policy = SpecPolicy(max_tokens=5, draft_cost=0.08)      # an EAGLE head: 8% of the target
    ks = [policy.choose([rate], [5], FIXED, ROW, 1)[0] for rate in (0.0, 0.1, 0.5, 0.8, 0.95)]
    assert ks[0] == ks[1] == 0 and 0 < ks[2] <= ks[3] <= ks[4] == 5, ks
    assert policy.choose([0.95], [2], FIXED, ROW, 1) == [2]            # capped by max_tokens or the context
    assert SpecPolicy(max_tokens=3, draft_cost=5.0, adaptive=False).choose([0.0], [9], FIXED, ROW, 1) == [3]
    state = SpecState()
    assert policy.choose([state.rate], [5], FIXED, ROW, 1)[0] > 0       # a new sequence tries
    for _ in range(8):
        state.record(2, 0)
    assert policy.choose([state.rate], [5], FIXED, ROW, 1) == [0]
    for _ in range(10):
        state.record(5, 5)
    assert policy.choose([state.rate], [5], FIXED, ROW, 1) == [5]


def test_the_batch_shares_the_proposers_pass() -> None:
    """In an 8-sequence step a lone EAGLE draft pays the head's whole weight reading, which its share of
    the step does not repay at a middling acceptance; eight sequences drafting at that rate share it."""
    head = SpecPolicy(max_tokens=5, draft_cost=0.08)
    lone = head.choose([0.6] + [0.0] * 7, [5] * 8, FIXED, ROW, 8)
    assert lone == [0] * 8, lone
    together = head.choose([0.6] * 8, [5] * 8, FIXED, ROW, 8)
    assert all(k > 0 for k in together), together
    assert head.choose([0.6], [5], FIXED, ROW, 1)[0] > 0              # alone in its step, it drafts
    free = SpecPolicy(max_tokens=5, draft_cost=0.0)                     # prompt lookup costs no pass
    assert free.choose([0.6] + [0.0] * 7, [5] * 8, FIXED, ROW, 8)[0] > 0
    # A proposer nearly as costly as the target never pays off, nor a free one where rows are dear.
    assert not SpecPolicy(max_tokens=5, draft_cost=0.8).can_pay_off(1, FIXED, ROW, 1)
    assert head.can_pay_off(1, FIXED, ROW, 1) and head.can_pay_off(8, FIXED, ROW, 8)
    assert not free.can_pay_off(64, FIXED, 0.02, 64)


def test_rejected_probes_wait_longer_and_an_accepted_one_resets_the_wait() -> None:
    policy = SpecPolicy(max_tokens=4, draft_cost=0.0, probe_every=4)

    def steps_to_probe(state: SpecState) -> int:
        for n in range(1, 100):                 # every step a tick: only the wait decides
            if state.idle(policy.probe_every, tick=True):
                return n
        raise AssertionError("never probed")

    state = SpecState()
    waits = []
    for _ in range(5):
        waits.append(steps_to_probe(state))
        state.record(1, 0)                      # the probe's draft rejected
    assert waits == [4, 8, 16, 32, 32], waits
    assert not state.idle(policy.probe_every, tick=False) and state.idle_steps == 1   # off a tick, never
    state.idle_steps = 0
    steps_to_probe(state)
    state.record(1, 1)                          # accepted: back to probe_every
    assert steps_to_probe(state) == 4


def test_idle_sequences_probe_together(smollm2_runner, smollm2_dir, tokenize) -> None:
    """Once drafts stop paying, every idle sequence probes (k = 1) on the same step, one in probe_every."""
    class Recording(NgramProposer):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[list[tuple[str, int]]] = []

        def propose(self, requests):
            self.calls.append([(r.request_id, r.num_tokens) for r in requests])
            return [[] for _ in requests]          # nothing accepted: every sequence's rate falls

    engine, _ = make_engine(smollm2_runner, smollm2_dir, 96)
    proposer = Recording()
    engine.proposer, engine.spec_policy = proposer, SpecPolicy(4, 0.08, probe_every=4)
    for rows in (1, 8):                            # a fixed step cost, whatever this machine's steps take
        engine.step_cost.observe(rows, FIXED + ROW * rows)
    engine.step_cost.observe = lambda rows, seconds: None
    for i, text in enumerate(STRUCTURED):
        state = SpecState()
        for _ in range(8):
            state.record(2, 0)                     # a history of rejected drafts: no k pays
        state.idle_steps = i                       # idle for different spells: the probes still coincide
        engine.add_request(f"r{i}", tokenize(text), SamplingParams(max_tokens=20, temperature=0.0))
        engine.scheduler.waiting[-1].spec = state
    run_all_checked(engine)
    assert proposer.calls, "nothing was probed"
    for call in proposer.calls:
        assert sorted(call) == [(f"r{i}", 1) for i in range(len(STRUCTURED))], call
    assert len(proposer.calls) <= 20 // 4


def test_step_cost_fits_fixed_plus_per_row() -> None:
    cost = StepCost(prior_row_ratio=0.06)
    for _ in range(20):                    # one size only: the slope is the prior's, the scale the data's
        cost.observe(1, 0.040)
    fixed, per_row = cost.fit()
    assert fixed + per_row == pytest.approx(0.040)
    assert per_row / fixed == pytest.approx(0.06)
    cost = StepCost(prior_row_ratio=0.06)
    for rows in (1, 4, 8, 16, 32):         # 30 ms of weights, 5 ms a row: the fit recovers both
        for _ in range(10):
            cost.observe(rows, 0.030 + 0.005 * rows)
    fixed, per_row = cost.fit()
    assert (fixed, per_row) == (pytest.approx(0.030), pytest.approx(0.005))


def test_step_cost_gives_a_row_price_only_when_it_was_measured() -> None:
    cost = StepCost(prior_row_ratio=0.06)
    assert cost.per_row_seconds() is None
    for _ in range(20):                    # one size only: no slope to fit, and the prior is not a measurement
        cost.observe(1, 0.032)
    assert cost.per_row_seconds() is None
    for rows in (1, 64, 1, 256):           # decodes and prefill chunks: the slope is measured
        for _ in range(5):
            cost.observe(rows, 0.030 + 0.002 * rows)
    assert cost.per_row_seconds() == pytest.approx(0.002)
    flat = StepCost()
    for rows in (1, 64, 1, 256):           # a step that gets faster with more rows is no sound fit
        flat.observe(rows, 0.050 - 0.0001 * rows)
    assert flat.per_row_seconds() is None
