"""How many tokens to draft for each sequence next step: chosen for the whole batch from each
sequence's own recent acceptance.

Each sequence keeps decayed counts of draft tokens that the target checked and accepted. With a
per-token acceptance rate a, drafting k tokens yields (1 - a^(k+1)) / (1 - a) tokens instead of 1.

The step's price comes from `StepCost`, the engine's own step times fitted as F + r * rows: each
verify row costs r. The proposer runs once per draft depth over the sequences drafting that deep, and
is priced like a model c times the target's size (c: its `cost_per_token`): c * F per depth, since it
reads its weights once whichever sequences draft, plus c * r per drafted token. So a step where the
deepest draft is D tokens and the drafts total S costs

    F + r * rows + r * (1 + c) * S + c * F * D

and yields sum over sequences of (1 - a^(k+1)) / (1 - a). The K of every sequence is chosen together
to maximise tokens per second: a lone draft pays the proposer's whole weight reading, while eight
sequences drafting together share it. At batch 1 this is the per-sequence rule tokens per cost of
1 + k * (c + r / (F + r)). Drafting must beat plain decoding by 2%, and a depth the one below it by 2%.

A sequence that drafts nothing for `probe_every` steps tries again (k = 1) at the next step whose
count is a multiple of `probe_every`, together with every other idle sequence, so that speculation
comes back when the text turns repetitive and the probes share one proposer pass. Each rejected probe
in a row doubles its wait (up to 8 times `probe_every`), so unique prose probes rarely. Nothing is
probed when drafting would gain less than 10% even at an acceptance rate of 0.9 (a draft model nearly
as costly as the target, or a batch so big that rows are dear).
"""
from __future__ import annotations

from dataclasses import dataclass

from backends.core.spec_state import SpecState

_HIGH_RATE = 0.9       # a proposer that would not pay off at this acceptance is never probed


@dataclass(frozen=True, slots=True)
class SpecPolicy:
    max_tokens: int            # k at most (--num-speculative-tokens)
    draft_cost: float          # the proposer's size against the target's (its cost_per_token)
    probe_every: int = 16      # steps between retries once a sequence's k fell to 0
    adaptive: bool = True      # False: always k = max_tokens

    def choose(self, rates: list[float], caps: list[int], fixed: float, per_row: float, rows: int) -> list[int]:
        """k for each candidate sequence (its acceptance rate, its cap; never above max_tokens) in a step of
        `rows` rows, for a step time of `fixed` + `per_row` * rows seconds (StepCost.fit)."""
        if not self.adaptive:
            return [min(self.max_tokens, cap) for cap in caps]
        return self._best(rates, caps, fixed, per_row, rows)[0]

    def plan(self, states: list[SpecState], caps: list[int], fixed: float, per_row: float, rows: int,
             tick: bool) -> list[int]:
        """`choose` for these sequences, then k = 1 for each idle one due a probe, when `tick` is a probe step."""
        ks = self.choose([state.rate for state in states], caps, fixed, per_row, rows)
        probing = tick and self.adaptive and self.can_pay_off(len(states), fixed, per_row, rows)
        return [k or int(state.idle(self.probe_every, probing)) for k, state in zip(ks, states, strict=True)]

    def can_pay_off(self, count: int, fixed: float, per_row: float, rows: int) -> bool:
        """Whether `count` sequences drafting together would gain at least 10% at a 0.9 acceptance rate."""
        if not self.adaptive:
            return True
        return count > 0 and self._best([_HIGH_RATE] * count, [self.max_tokens] * count, fixed, per_row, rows)[1] >= 1.1

    def _best(self, rates: list[float], caps: list[int], fixed: float, per_row: float,
              rows: int) -> tuple[list[int], float]:
        """The ks with the most tokens per second, and their gain over plain decoding (1 when all are 0).

        At a price per draft token, each sequence's best k is where one more draft would add fewer tokens
        (rate^k) than it costs; a depth D caps every k at D. The price is the throughput to beat, raised
        to the best found (Dinkelbach's step for a ratio), for a few rounds."""
        c = self.draft_cost
        rows = max(rows, len(rates), 1)
        plain_seconds = fixed + per_row * rows
        row_seconds = per_row * (1.0 + c)
        best_ks, best_gain = [0] * len(rates), 1.0
        for _ in range(3):
            price = best_gain * rows / plain_seconds * row_seconds      # tokens a draft token must bring
            gains = [_gains(rate, cap, price) for rate, cap in zip(rates, caps, strict=True)]
            deepest = min(self.max_tokens, max((len(g) - 1 for g in gains), default=0))
            found = False
            for depth in range(1, deepest + 1):
                ks = [min(depth, len(g) - 1) for g in gains]
                extra = sum(g[k] for g, k in zip(gains, ks, strict=True))
                seconds = plain_seconds + row_seconds * sum(ks) + c * fixed * depth
                gain = (rows + extra) / seconds * plain_seconds / rows
                if gain > best_gain * 1.02:
                    best_ks, best_gain, found = ks, gain, True
            if not found:
                break
        return best_ks, best_gain


def _gains(rate: float, cap: int, price: float) -> list[float]:
    """Expected extra tokens from drafting 0, 1, ... k tokens, up to the k where one more draft would add
    (rate^(k+1)) no more than it costs (`price`) or `cap`."""
    gains, more = [0.0], 1.0
    while len(gains) <= cap:
        more *= rate
        if more <= price:
            break
        gains.append(gains[-1] + more)
    return gains


class StepCost:
    """The engine's step time as fixed + per_row * rows, fitted online by decayed least squares.

    SpecPolicy prices drafts with it, and KV tiers a prompt token. Until the steps seen vary enough in
    size to fit the slope, the ratio per_row / fixed is the prior (0.06: SmolLM2 in fp32 on a 2-core CPU at batch 1,
    docs/benchmarks.md).
    """

    def __init__(self, prior_row_ratio: float = 0.06, decay: float = 0.99) -> None:
        self.prior_row_ratio = prior_row_ratio
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds

    def fit(self) -> tuple[float, float]:
        """(fixed, per_row) seconds; the prior's shape scaled to the mean step when the slope is unknown."""
        if self._w == 0.0:
            return 1.0, self.prior_row_ratio
        line = self._line(min_variance=1.0)
        if line is not None:
            return line
        mean_x, mean_y = self._x / self._w, self._y / self._w
        fixed = mean_y / (1.0 + self.prior_row_ratio * mean_x)
        return fixed, fixed * self.prior_row_ratio

    def per_row_seconds(self, min_variance: float = 16.0) -> float | None:
        """The fitted seconds one more row adds to a step, when the steps seen spread their row counts
        (variance at least `min_variance`) and the fit is sound; None otherwise (never the prior)."""
        line = self._line(max(1.0, min_variance))
        return None if line is None else line[1]

    def _line(self, min_variance: float) -> tuple[float, float] | None:
        """(fixed, per_row) by least squares, when the row counts' variance is at least `min_variance` and
        both come out positive; None otherwise."""
        if self._w == 0.0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < min_variance:
            return None
        per_row = (self._xy / self._w - mean_x * mean_y) / var_x
        fixed = mean_y - per_row * mean_x
        return (fixed, per_row) if per_row > 0.0 and fixed > 0.0 else None
