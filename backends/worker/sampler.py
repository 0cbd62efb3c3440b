"""Turns one step's logits into one token per sequence, vectorized over the batch.

Randomness is per row, from (seed, number of tokens generated so far) only: one uniform from
splitmix64 through the row's CDF. So a seeded sequence samples the same tokens however the batch
is composed and wherever the step runs.

Verification of drafts (speculative decoding) is sampling too, and plain decoding is its case with no drafts:
one target forward gave logits for a sequence's last token and each of its K drafts; the sampler draws the
target's own token at each of those K + 1 positions, and the drafts are accepted up to the first that differs
from it. Position i is sampled exactly as plain decoding would sample output token n + i (n: tokens out so
far): with penalties and min_tokens computed over the outputs plus drafts[:i], and with the uniform of
(seed, n + i). A draft is a deterministic guess, so this is rejection sampling against a one-hot draft
distribution: draft i is accepted with the target's probability of it, and on a rejection the token drawn is
distributed as the target's distribution without the draft, renormalised. The accepted tokens are therefore
distributed exactly as the target's; greedy decoding and seeded sampling give the very tokens plain decoding
gives on the same logits.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.core.outputs import TokenLogprob
from backends.core.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
MAX_LOGPROBS = 20
# Top-k/top-p work on this many best tokens first (exact fallback beyond them).
_CANDIDATES = 256
# Vocabulary chunk of the two-level inverse CDF.
_CDF_CHUNK = 256


@dataclass(frozen=True, slots=True)
class SampleRow:
    params: SamplingParams                # the sequence's sampling parameters
    seed: int                             # resolved seed (random at arrival when params.seed is None)
    prompt_token_ids: Sequence[int]       # for repetition_penalty
    output_token_ids: Sequence[int]       # tokens generated so far: penalties, min_tokens, step index
    eos_token_ids: tuple[int, ...]        # masked under ignore_eos and before min_tokens
    allowed: torch.Tensor | None = None   # [vocab] bool: the only tokens it may sample (JSON mode); None: any


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: tuple[int, ...]                    # one sampled token per row
    logprobs: tuple[TokenLogprob | None, ...]     # per row; None where params.logprobs is None


def step_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): a generator seed for one row at one step (63 bits)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index of its largest value (NaN counts as largest), as argmax gives it: on the
    CPU, max's indices take a third of argmax's time (32 x 49,152 float32 rows: 0.34 against 1.0 ms)."""
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
    """logits: [num_rows, vocab] float; one row per sequence that wants a token this step."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sequences")
    logits = logits.float()
    # Logprobs are reported from the RAW model distribution (before penalties, masks,
    # temperature, top-k/p), as vLLM does by default: they describe the model, not the sampler.
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    logits = _mask_banned_tokens(apply_penalties(add_logit_bias(logits, rows), rows), rows)
    if any(r.allowed is not None for r in rows):
        logits = _keep_allowed(logits, rows)

    greedy_idx = [i for i, r in enumerate(rows) if r.params.greedy]
    random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_idx:   # the usual cases take no index tensors (each a copy up, a sync on CUDA)
        tokens = greedy_tokens(logits)
    elif not greedy_idx:
        tokens = _inverse_cdf(filtered_probs(logits, rows), rows)
    else:
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        gi = torch.tensor(greedy_idx, device=logits.device)
        tokens[gi] = greedy_tokens(logits[gi])
        ri = torch.tensor(random_idx, device=logits.device)
        sub = [rows[i] for i in random_idx]
        tokens[ri] = _inverse_cdf(filtered_probs(logits[ri], sub), sub)
    token_list = tokens.tolist()
    lps = _logprobs(raw_logprobs, token_list, rows) if raw_logprobs is not None else (None,) * len(rows)
    return SamplerOutput(tuple(token_list), lps)


def _token_matrix(token_lists: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_rows, max_len] token ids and a validity mask. Padding repeats the row's first token
    (or 0 for an empty row), so that a scatter of per-token values never writes conflicting
    values to one index."""
    width = max(1, max((len(t) for t in token_lists), default=0))
    ids = torch.zeros(len(token_lists), width, dtype=torch.long)
    valid = torch.zeros(len(token_lists), width, dtype=torch.bool)
    for i, toks in enumerate(token_lists):
        if toks:
            ids[i, :len(toks)] = torch.tensor(list(toks), dtype=torch.long)
            ids[i, len(toks):] = toks[0]
            valid[i, :len(toks)] = True
    return ids.to(device), valid.to(device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties, touching only the tokens seen (sparse: a
    dense [rows, vocab] pass costs several ms per op on CPU). Returns a new tensor if any applies."""
    dev = logits.device
    rep = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in rep):
        # HF semantics over prompt + output: positive logits divided, negative multiplied.
        ids, valid = _token_matrix([list(r.prompt_token_ids) + list(r.output_token_ids) for r in rows], dev)
        ids = ids.clamp_(0, logits.shape[1] - 1)
        # Padding repeats a real token, so it takes the row's penalty; an empty row's pad none.
        penalty = torch.where(valid.any(dim=1, keepdim=True), torch.tensor(rep, device=dev).unsqueeze(1),
                              1.0).expand_as(ids)                                        # [n, L]
        seen = logits.gather(1, ids)
        logits = logits.scatter(1, ids, torch.where(seen > 0, seen / penalty, seen * penalty))
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    if any(freq) or any(pres):
        # OpenAI semantics over output tokens: logit -= count * frequency + (count > 0) * presence.
        ids, valid = _token_matrix([r.output_token_ids for r in rows], dev)
        ids = ids.clamp_(0, logits.shape[1] - 1)
        zero = torch.zeros((), device=dev)
        per_use = torch.where(valid, -torch.tensor(freq, device=dev).unsqueeze(1), zero)   # [n, L]
        logits = logits.scatter_add(1, ids, per_use)
        once = torch.where(valid.any(dim=1, keepdim=True), torch.tensor(pres, device=dev).unsqueeze(1),
                           zero).expand_as(ids)
        logits = logits.scatter(1, ids, logits.gather(1, ids) - once)
    return logits


def add_logit_bias(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Each row's `logit_bias` added to its tokens' logits, before the penalties (as vLLM and transformers'
    `sequence_bias` order them). Never writes into the caller's tensor."""
    if not any(r.params.logit_bias for r in rows):
        return logits
    vocab = logits.shape[1]
    entries = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if 0 <= t < vocab]
    if not entries:
        return logits
    row_idx, tok_idx, bias = zip(*entries, strict=True)
    index = torch.tensor([row_idx, tok_idx], dtype=torch.long).to(logits.device, non_blocking=True)
    return logits.index_put((index[0], index[1]), torch.tensor(bias, dtype=logits.dtype).to(logits.device),
                            accumulate=True)


def _mask_banned_tokens(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """EOS and stop ids are banned before min_tokens; EOS is banned throughout under ignore_eos.
    Never writes into the caller's tensor."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        banned: set[int] = set()
        if r.params.ignore_eos:
            banned.update(r.eos_token_ids)
        if len(r.output_token_ids) < r.params.min_tokens:
            banned.update(r.eos_token_ids)
            banned.update(r.params.stop_token_ids)
        for t in banned:
            if 0 <= t < vocab:
                row_idx.append(i)
                tok_idx.append(t)
    if row_idx:   # one copy of the indices up, and -inf filled on the device (no copy)
        index = torch.tensor([row_idx, tok_idx], dtype=torch.long).to(logits.device, non_blocking=True)
        logits = logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))
    return logits


def _keep_allowed(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """-inf for every token a row's `allowed` mask leaves out. Never writes into the caller's tensor."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r.allowed is not None:
            keep[i] = r.allowed.to(logits.device, non_blocking=True)
    return logits.masked_fill(~keep, float("-inf"))


def filtered_probs(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p (nucleus) and min-p; returns [n, vocab] probabilities."""
    dev = logits.device
    temp = torch.tensor([r.params.temperature for r in rows], device=dev).unsqueeze(1)
    # A penalty far below 1 can scale a seen token's logit past float32's range: +inf would make the softmax
    # NaN, so it is the largest finite value, and such tokens share the mass (the limit it tends to).
    scaled = (logits / temp).clamp_(max=torch.finfo(logits.dtype).max)
    logits = _top_k_top_p(scaled, [r.params.top_k for r in rows], [r.params.top_p for r in rows])
    probs = logits.softmax(dim=-1)
    min_p = [r.params.min_p for r in rows]
    if any(p > 0.0 for p in min_p):
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=dev).unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask all but each row's top-k, then its nucleus. Works on the best `_CANDIDATES` tokens
    (a full-vocabulary sort costs ~100 ms for 32 rows on CPU) and falls back to the full sort only
    for rows whose nucleus does not close inside them, so the result is exact."""
    _, vocab = logits.shape                                              # [n, vocab]
    dev = logits.device
    k_eff = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
    p = torch.tensor(top_p, device=dev, dtype=logits.dtype)
    need = (k_eff < vocab) | (p < 1.0)                                   # [n]
    if not bool(need.any()):
        return logits
    max_k = max([k for k in top_k if 0 < k < vocab], default=0)
    only_top_k = bool((k_eff[need] < vocab).all()) and not bool((p < 1.0).any())
    num_cand = min(vocab, max_k if only_top_k else max(_CANDIDATES, max_k))
    vals, idx = logits.topk(num_cand, dim=-1)                            # [n, num_cand], best first
    rank = torch.arange(num_cand, device=dev).unsqueeze(0)
    vals = vals.masked_fill(rank >= k_eff.unsqueeze(1), float("-inf"))
    inside = k_eff <= num_cand               # the whole top-k distribution is among the candidates
    lse = torch.where(inside, vals.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (vals - lse.unsqueeze(1)).exp()
    cum = probs.cumsum(dim=-1)
    # Drop a token once the mass of better ones reaches top_p; keep the best; top_p = 1 drops none.
    drop = ((cum - probs) >= p.unsqueeze(1)) & (p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    vals = vals.masked_fill(drop, float("-inf"))
    out = torch.where(need.unsqueeze(1), torch.full_like(logits, float("-inf")).scatter_(1, idx, vals), logits)
    open_rows = (need & ~inside & (cum[:, -1] < p)).nonzero().flatten()
    if open_rows.numel():
        out[open_rows] = _sorted_top_k_top_p(logits[open_rows], k_eff[open_rows], p[open_rows])
    return out


def _sorted_top_k_top_p(logits: torch.Tensor, k_eff: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)        # [m, vocab] each
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(rank >= k_eff.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    drop = ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= p.unsqueeze(1)) & (p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def step_uniform(seed: int, step: int) -> float:
    """A uniform draw in [0, 1) determined by (seed, step) alone, identical on every device."""
    return (step_seed(seed, step) >> 10) / float(1 << 53)


def _inverse_cdf(probs: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """One uniform per row through the row's CDF: exact sampling from `probs`, zero-probability
    tokens never drawn. Two levels (chunk sums, then one chunk) keep float64 accuracy without a
    float64 cumsum over the whole vocabulary."""
    n, vocab = probs.shape
    dev = probs.device
    padded = F.pad(probs, (0, -vocab % _CDF_CHUNK)) if vocab % _CDF_CHUNK else probs
    chunks = padded.reshape(n, -1, _CDF_CHUNK)                                    # [n, C, chunk]
    cdf = chunks.sum(dim=-1).double().cumsum(dim=-1)                             # [n, C]
    u = torch.tensor([step_uniform(r.seed, len(r.output_token_ids)) for r in rows],
                     dtype=torch.float64, device=dev)
    target = (u * cdf[:, -1]).unsqueeze(1)                                       # [n, 1]
    c = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # [n, 1]
    before = torch.where(c > 0, cdf.gather(1, (c - 1).clamp_(min=0)), torch.zeros_like(target))
    inner = chunks.gather(1, c.unsqueeze(-1).expand(n, 1, _CDF_CHUNK)).squeeze(1).double().cumsum(dim=-1)
    # Rounding must not push the draw past the chunk's last token with probability > 0.
    rest = torch.minimum(target - before, torch.nextafter(inner[:, -1:], torch.zeros_like(inner[:, -1:])))
    j = torch.searchsorted(inner, rest, right=True).clamp_(max=_CDF_CHUNK - 1)     # [n, 1]
    return (c * _CDF_CHUNK + j).squeeze(1)


def _logprobs(raw: torch.Tensor, tokens: list[int], rows: Sequence[SampleRow]
              ) -> tuple[TokenLogprob | None, ...]:
    idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    k = min(max(min(rows[i].params.logprobs or 0, MAX_LOGPROBS) for i in idx), raw.shape[1])
    sub = raw[torch.tensor(idx, device=raw.device)]                     # [m, vocab]
    chosen = sub.gather(1, torch.tensor([[tokens[i]] for i in idx], device=raw.device)).squeeze(1).tolist()
    top_val_rows, top_id_rows = (sub.topk(k, dim=-1) if k > 0 else (sub[:, :0], sub[:, :0].long()))
    top_vals, top_ids = top_val_rows.tolist(), top_id_rows.tolist()
    out: list[TokenLogprob | None] = [None] * len(rows)
    for j, i in enumerate(idx):
        ki = min(rows[i].params.logprobs or 0, MAX_LOGPROBS)
        out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(top_ids[j][:ki], top_vals[j][:ki], strict=True)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Verified:
    token_ids: tuple[int, ...]                    # accepted drafts, then the target's own next token
    logprobs: tuple[TokenLogprob | None, ...]     # parallel to token_ids
    num_accepted: int                             # drafts accepted (len(token_ids) - 1)


def expand_rows(row: SampleRow, drafts: Sequence[int]) -> list[SampleRow]:
    """The K + 1 sampler rows of one sequence: row i sees drafts[:i] as already generated."""
    if not drafts:
        return [row]            # plain decoding: no copy of the outputs
    out = list(row.output_token_ids)
    return [SampleRow(row.params, row.seed, row.prompt_token_ids, out + list(drafts[:i]), row.eos_token_ids)
            for i in range(len(drafts) + 1)]


def verify(logits: torch.Tensor, rows: Sequence[SampleRow], drafts: Sequence[Sequence[int]]) -> list[Verified]:
    """logits: [sum(len(d) + 1 for d in drafts), vocab], each sequence's rows consecutive (its last
    token's, then one per draft). rows[j], drafts[j]: sequence j's sampler row and drafts."""
    expanded = [r for row, d in zip(rows, drafts, strict=True) for r in expand_rows(row, d)]
    result = sample(logits, expanded)
    out: list[Verified] = []
    start = 0
    for d in drafts:
        tokens = result.token_ids[start:start + len(d) + 1]
        accepted = 0
        while accepted < len(d) and tokens[accepted] == d[accepted]:
            accepted += 1
        out.append(Verified(tuple(tokens[:accepted + 1]), tuple(result.logprobs[start:start + accepted + 1]),
                            accepted))
        start += len(d) + 1
    return out
