"""How far two float32 evaluations of one model may differ, measured rather than guessed, and which
tokens that rounding cannot change.

Every float32 multiply-add rounds. Another blocking or reduction order (another batch composition,
thread count or CPU ISA; transformers' kernels against ours) rounds differently, and nothing in the
code makes such results bit-identical. So tests compare them within `logit_tolerance`: the largest
deviation of transformers' float32 logits from its float64 logits on the same tokens (the size of
float32 rounding in this computation, measured in the same run) times TOLERANCE_MULTIPLE = 8. Each
float32 evaluation lies about that far from the exact result; x4 covers an evaluation blocked
differently or along a longer path (our paged decode measured up to 3x on the 2-core EPYC), and x2
two such evaluations. Bugs (a row reading another row's KV, leaked padding) move logits by 0.1-10.
Embeddings (normalised final hidden states) are compared the same way, within `embedding_tolerance`.

A sampled token depends on the logits only through comparisons. `choices` marks a reference position
clear when no logits within the tolerance of the reference's would sample another token; two runs
must agree up to the first position that is not clear, and may part there (`assert_same_tokens`).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from backends.core.sampling_params import SamplingParams
from backends.worker.sampler import SampleRow, apply_penalties, sample, step_uniform

TOLERANCE_MULTIPLE = 8
# Below this share of clear positions a comparison would say little: the tolerance must be small
# against the margins the model produces. Measured on the 2-core EPYC: greedy 100% of positions,
# seeded draws at temperature 0.9 on text prompts 94-98% (a draw from a flat distribution can sit
# within the CDF's rounding of its neighbour), on random-token prompts with top_k 20 about 88%.
MIN_CLEAR_SHARE = 0.8


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in float64: its logits stand in for the exact ones."""
    return copy.deepcopy(model).double().eval()


def logit_tolerance(model32: torch.nn.Module, model64: torch.nn.Module, rows: Sequence[Sequence[int]]) -> float:
    """TOLERANCE_MULTIPLE x the largest |float32 - float64| logit over every position of `rows`."""
    worst = 0.0
    with torch.inference_mode():
        for row in rows:
            ids = torch.tensor([list(row)])
            deviation = (model32(ids).logits[0].double() - model64(ids).logits[0].double()).abs().max().item()
            worst = max(worst, deviation)
    assert worst > 0.0, "float32 logits equal to float64 ones: the reference is not running in float32"
    return TOLERANCE_MULTIPLE * worst


def last_token_embedding(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """transformers' embedding of `ids` as the worker pools it: the last token's final hidden state (LlamaModel's
    hidden_states[-1] is taken after its final norm), L2-normalised, in float64 [hidden_size]."""
    with torch.inference_mode():
        hidden = model(torch.tensor([list(ids)]), output_hidden_states=True).hidden_states[-1][0, -1]
    return torch.nn.functional.normalize(hidden.double(), dim=-1)


def embedding_tolerance(model32: torch.nn.Module, model64: torch.nn.Module, rows: Sequence[Sequence[int]]) -> float:
    """TOLERANCE_MULTIPLE x the largest |float32 - float64| component of `last_token_embedding` over `rows`."""
    worst = max((last_token_embedding(model32, row) - last_token_embedding(model64, row)).abs().max().item()
                for row in rows)
    assert worst > 0.0, "float32 embeddings equal to float64 ones: the reference is not running in float32"
    return TOLERANCE_MULTIPLE * worst


def teacher_forced_logits(model: torch.nn.Module, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """[len(output), vocab] float32: the logits from which each token of `output` was chosen."""
    with torch.inference_mode():
        logits = model(torch.tensor([[*prompt, *output]])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) + len(output) - 1]


@dataclass(frozen=True, slots=True)
class Choice:
    token_id: int     # what the sampler draws from the reference logits
    clear: bool       # logits within the tolerance of the reference's all draw the same token


def choices(logits: torch.Tensor, params: SamplingParams, seed: int | None, eos_token_ids: Sequence[int],
            tolerance: float, prompt: Sequence[int] = ()) -> list[Choice]:
    """One Choice per row of `logits` ([steps, vocab]; row i draws output token i after rows 0..i-1)."""
    out: list[Choice] = []
    for row in logits:
        out.append(choice(row, params, seed, prompt, [c.token_id for c in out], eos_token_ids, tolerance))
    return out


def choice(logits: torch.Tensor, params: SamplingParams, seed: int | None, prompt: Sequence[int],
           output: Sequence[int], eos_token_ids: Sequence[int], tolerance: float) -> Choice:
    """The sampler's draw from one row of logits ([vocab]) after `output`, and whether it is clear."""
    if params.min_p:
        raise NotImplementedError("margins for min_p are not worked out")
    sample_row = SampleRow(params, seed or 0, tuple(prompt), tuple(output), tuple(eos_token_ids))
    token = sample(logits[None].float(), [sample_row]).token_ids[0]
    # The bias is added first (as transformers' sequence_bias and vLLM order them), then the penalties, which are
    # elementwise: they scale a logit's error by the repetition penalty at most.
    biased = logits[None].float().clone()
    for token_id, bias in params.logit_bias:
        biased[0, token_id] += bias
    penalized = apply_penalties(biased, [sample_row])[0].double()
    tolerance *= max(params.repetition_penalty, 1 / params.repetition_penalty)
    step = len(output)
    banned = set(eos_token_ids) if params.ignore_eos or step < params.min_tokens else set()
    if step < params.min_tokens:
        banned.update(params.stop_token_ids)
    penalized[sorted(banned)] = -math.inf
    if params.greedy:
        top = penalized.topk(2)
        clear = bool(top.values[0] - top.values[1] > 2 * tolerance)
        assert not clear or int(top.indices[0]) == token, (step, token)   # a self-check of this helper
    else:
        clear = _sampled_margin(penalized, params, seed or 0, step, tolerance, token)
    return Choice(token, clear)


def _sampled_margin(logits: torch.Tensor, params: SamplingParams, seed: int, step: int, tolerance: float,
                    token: int) -> bool:
    """Whether every perturbation of each logit (a float64 row, banned tokens -inf) by at most
    `tolerance` still draws `token` (the sampler's draw from the row itself).

    After the temperature each logit moves by at most t = tolerance / T, so a gap between two by at
    most 2t, and a normalised probability, or a sum of them, by a factor within exp(+-2t). Top-k must
    be decided outright. Top-p may leave some tokens of the tail either side of the nucleus' edge
    ("maybe" members); the CDF bounds below count them in for the upper bound and out for the lower."""
    vocab = logits.numel()
    t = tolerance / params.temperature
    z = logits / params.temperature
    sorted_z, order = z.sort(descending=True)
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k < vocab and not (sorted_z[k - 1] - sorted_z[k] > 2 * t or sorted_z[k] == -math.inf):
        return False
    top_z, top_ids = sorted_z[:k], order[:k]
    top_z, top_ids = top_z[top_z > -math.inf], top_ids[top_z > -math.inf]
    weight = torch.exp(top_z - top_z[0])                              # unnormalised probabilities
    sure = torch.ones_like(top_z, dtype=torch.bool)
    maybe = torch.zeros_like(sure)
    if params.top_p < 1.0:                  # dropped when the mass of better tokens reaches top_p
        p = weight / weight.sum()
        cum = torch.cat([p.new_zeros(1), p.cumsum(0)])
        ascending = (-top_z).contiguous()
        surely_better = cum[torch.searchsorted(ascending, -(top_z + 2 * t))]                  # above by > 2t
        maybe_better = cum[torch.searchsorted(ascending, -(top_z - 2 * t), right=True)] - p   # or within 2t
        sure = maybe_better * math.exp(2 * t) < params.top_p
        maybe = ~sure & ~(surely_better * math.exp(-2 * t) >= params.top_p)
    in_sure = torch.zeros(vocab, dtype=torch.float64)
    in_maybe = torch.zeros(vocab, dtype=torch.float64)
    in_sure[top_ids[sure]] = weight[sure]
    in_maybe[top_ids[maybe]] = weight[maybe]
    if in_sure[token] == 0:
        return False
    a, m = in_sure.cumsum(0), in_maybe.cumsum(0)       # in vocabulary order, as the sampler walks the CDF
    total_sure, total_maybe = a[-1].item(), m[-1].item()
    u = step_uniform(seed, step)
    # CDF after `token` is at least its least kept mass at its smallest over the most the whole can be ...
    lower = a[token].item() * math.exp(-t) / ((total_sure + total_maybe) * math.exp(t))
    # ... and before `token` at most everything that may precede it at its largest against the least after it.
    before = (a[token - 1] + m[token - 1]).item() * math.exp(t) if token > 0 else 0.0
    upper = before / (before + (total_sure - a[token - 1].item()) * math.exp(-t)) if token > 0 else 0.0
    return upper < u < lower


def assert_mostly_clear(all_choices: Sequence[Sequence[Choice]], what: str) -> None:
    flat = [c.clear for cs in all_choices for c in cs]
    assert flat and sum(flat) >= MIN_CLEAR_SHARE * len(flat), (
        f"{what}: only {sum(flat)} of {len(flat)} reference choices are clear of the rounding tolerance")


def first_unclear(reference: Sequence[Choice]) -> int:
    """The first position whose choice rounding could change (len(reference) if none)."""
    return next((i for i, c in enumerate(reference) if not c.clear), len(reference))


def assert_same_tokens(got: Sequence[int], want: Sequence[int], reference: Sequence[Choice], what: str) -> bool:
    """`got` (another run) against `want` (the run, or a run within the tolerance of the one, whose
    logits gave `reference`), token for token up to the first position where `want` could have gone
    either way; there they may part, and nothing after it is compared. True if they never part."""
    for i, (g, w, choice) in enumerate(zip(got, want, reference, strict=False)):
        if choice.clear:
            assert w == choice.token_id, f"{what}: the reference's token {i} is {w}; its logits give {choice.token_id}"
        if g != w:
            assert not choice.clear, f"{what}: token {i} is {g}, not {w}, where no rounding can change the choice"
            return False
    assert len(got) == len(want), f"{what}: {len(got)} tokens against {len(want)}: {got} vs {want}"
    return True


def assert_same_text(got: str, want_ids: Sequence[int], reference: Sequence[Choice],
                     decode: Callable[[Sequence[int]], str], what: str) -> None:
    """`got` is the text of `want_ids`, or, past a position rounding could decide otherwise, starts
    with the text before it."""
    cut = first_unclear(reference)
    if cut >= len(want_ids):
        assert got == decode(want_ids), what
    else:
        assert got.startswith(decode(want_ids[:cut]).rstrip("\ufffd")), what
